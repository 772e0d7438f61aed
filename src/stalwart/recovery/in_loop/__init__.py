"""In-loop recovery, in one folder: a survivor of a peer's failure stays in its training loop.

- `survivor.py`: what a worker process keeps across re-formations (the one owner of the request signal's state,
  the stash of live tensors, the way back to its agent, the live Jobs);
- `group_side.py`: the job's side of its re-formable group (failures absorbed, the step's update dropped, the
  group left and joined again);
- `port.py`: the typed interface the drivers below talk to the Job through (they never touch its private
  attributes);
- `driver.py`: after a failure inside the loop, re-form at once or train on shrunk, then re-form;
- `shrunk.py`: the steps the survivors train on shrunk while a replacement starts;
- `late_join.py`: a replacement (or a warm spare) that joins late, and the job growing back.

recovery/reform.py holds what the fallback (the script run again in the same process) shares with them.
"""

from stalwart.recovery.in_loop.group_side import GroupFailed, Grow, InLoop, NewWorldForShards, NothingToGoBackTo

__all__ = ["GroupFailed", "Grow", "InLoop", "NewWorldForShards", "NothingToGoBackTo"]
