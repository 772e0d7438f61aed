"""A load: reading a committed checkpoint back and proving every byte is the one its manifest committed."""
