"""Checkpoint I/O for the models: Hugging Face config and weights (`hf`), the safetensors format
(`safetensors`), and gs:// access (`storage`). May import: models' presets and parallel.
"""
