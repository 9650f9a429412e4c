"""remat.runtime: the VM (``vm``: ``VM``, ``run``, ``RunStats``) and its storage-based memory
tracker (``memory``: ``MemoryTracker``, ``storage_of``)."""
