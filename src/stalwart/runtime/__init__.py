"""Where this process stands and how it lives: process helpers shared by every layer (see docs/architecture.md)."""
