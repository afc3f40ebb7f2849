"""What each worker holds for a request (see room.py)."""
