"""Fault injection: the catalogue of faults and where they fire."""

from stalwart.chaos.faults import FAULTS_ENV, Fault, FaultInjector, parse_faults

__all__ = ["FAULTS_ENV", "Fault", "FaultInjector", "parse_faults"]
