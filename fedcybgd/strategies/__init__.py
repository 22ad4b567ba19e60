"""Strategies: FedCyBGD, its block schedules, aggregators and round record."""

from fedcybgd.strategies.aggregate import Aggregator, Upload, weighted_mean
from fedcybgd.strategies.fedcybgd import FedCyBGD, RoundInFlight
from fedcybgd.strategies.record import RoundRecord, run_totals
from fedcybgd.strategies.schedule import (
    BlockSchedule,
    Schedule,
    build_schedule,
    register_schedule,
    schedule_names,
)

__all__ = [
    "Aggregator",
    "BlockSchedule",
    "FedCyBGD",
    "RoundInFlight",
    "RoundRecord",
    "Schedule",
    "Upload",
    "build_schedule",
    "register_schedule",
    "run_totals",
    "schedule_names",
    "weighted_mean",
]
