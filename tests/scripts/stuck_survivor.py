"""For tests/test_stack_dump.py: in the first round rank 1 dies and rank 0 neither leaves the failed group nor
answers the agent's ask to re-form (the signal blocked, as a wait in C++ that nothing reaches would); both end well
in the next round."""

import os
import signal
import time

from stalwart.recovery.reform import REFORM_SIGNAL


def stuck_in_a_wait_nothing_reaches() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {REFORM_SIGNAL})
    time.sleep(120)


if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        time.sleep(1)
        os._exit(3)
    stuck_in_a_wait_nothing_reaches()
print(f"rank {os.environ['RANK']} done", flush=True)
