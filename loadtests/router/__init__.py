"""Router: what one routing decision, one proxied request and the KV feed cost."""
