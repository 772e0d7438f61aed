"""The recovery ladder beyond process restarts (../shared/DESIGN.md): L1, survivors re-forming in place."""
