"""``hf_zoo`` importable; models are built from configs (random weights, nothing downloaded)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
