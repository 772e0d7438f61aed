"""A save: the snapshot into staging memory (training side), the persist and the commit (persister side)."""
