"""Checkpoints: HF-format safetensors loaded and saved block by block (`hf`), torch.distributed.checkpoint
(`dcp`), file safety (`files`), key names as transformers writes them (`keys`), slices of safetensors
files (`safetensors_io`)."""

from autopar.checkpoint.dcp import load_distributed, save_distributed
from autopar.checkpoint.hf import load_full_state_dict, load_safetensors, meta_init, restore_buffers
from autopar.checkpoint.pretrained import from_pretrained, save_pretrained
from autopar.errors import CheckpointWarning
from autopar.parallel.module import EXTENSIONS

EXTENSIONS["save_pretrained"] = save_pretrained  # pmodel.save_pretrained(path), as transformers and peft name it

__all__ = ["from_pretrained", "save_pretrained", "load_full_state_dict", "load_safetensors", "meta_init",
           "restore_buffers",
           "save_distributed", "load_distributed", "CheckpointWarning"]
