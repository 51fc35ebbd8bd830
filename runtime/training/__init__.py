"""The model as workers train it: model families, forward and backward passes, the optimiser, layer state, data, and
the steady host allocator of a computing process."""

import os

# model=hf reads a checkpoint by path (config.json through its config class, tensors through safetensors), never
# through the Hugging Face Hub; offline mode keeps any transformers helper from reaching for it too. Set here, before
# any module of this package imports transformers, and inherited by the processes a job starts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
