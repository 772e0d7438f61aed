"""`stalwart sim`: failures of a training job on clusters far larger than this machine, and what they cost."""
