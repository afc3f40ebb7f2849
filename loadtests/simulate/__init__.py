"""Simulate: the routing policies over simulated workers, from 8 to 1,000 of them."""
