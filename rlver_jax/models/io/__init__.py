"""Checkpoint I/O for the models: Hugging Face config and weights (`hf`), the safetensors format
(`safetensors`), gs:// access (`storage`), and Hub ids resolved to huggingface_hub's cache (`hub`).
May import: models' presets and parallel.
"""
