"""Capture: an nn.Module and one call's inputs -> an aten GraphModule (`export`), with grad-mode and
autocast regions inlined (`regions`) and in-place ops on intermediates made functional (`functionalize`)."""
