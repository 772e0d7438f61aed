"""Event log (JSONL) shared by the launcher and its workers."""

from stalwart.telemetry.events import EVENT_LOG_ENV, EventLog, read_events

__all__ = ["EVENT_LOG_ENV", "EventLog", "read_events"]
