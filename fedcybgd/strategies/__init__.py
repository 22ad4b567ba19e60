"""Strategies: FedCyBGD and its block schedules."""

from fedcybgd.strategies.fedcybgd import FedCyBGD, RoundLog
from fedcybgd.strategies.schedule import BlockSchedule

__all__ = ["BlockSchedule", "FedCyBGD", "RoundLog"]
