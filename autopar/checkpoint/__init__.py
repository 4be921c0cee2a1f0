"""Checkpoints: HF-format safetensors loaded and saved block by block (`hf`), torch.distributed.checkpoint
(`dcp`), file safety (`files`), key names as transformers writes them (`keys`), slices of safetensors
files (`safetensors_io`)."""

from autopar.checkpoint.dcp import load_distributed, save_distributed
from autopar.checkpoint.hf import (from_pretrained, load_full_state_dict, load_safetensors, meta_init,
                                   restore_buffers, save_pretrained)
from autopar.errors import CheckpointWarning

__all__ = ["from_pretrained", "save_pretrained", "load_full_state_dict", "load_safetensors", "meta_init",
           "restore_buffers",
           "save_distributed", "load_distributed", "CheckpointWarning"]
