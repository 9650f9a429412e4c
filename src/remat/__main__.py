"""``python -m remat ...``: the ``remat`` command (:mod:`remat.cli`)."""
from .cli import run

if __name__ == "__main__":
    run()
