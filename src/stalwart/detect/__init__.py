"""Detection: worker heartbeats and calibrated hang timeouts (the `detect` layer of docs/architecture.md)."""
