"""Policies as Hugging Face causal LMs: loading (GGUF files included), saving, LoRA, the tiny model, sampling
engines, PPO, precision, AdamW and its state, the update's processes and FSDP. Imports only `pipeline.data`."""
