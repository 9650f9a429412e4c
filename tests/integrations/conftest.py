"""Integrations with other libraries' training loops: tiny models from configs (random weights,
nothing downloaded)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
