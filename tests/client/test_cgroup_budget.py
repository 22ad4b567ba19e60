"""A node under a hard memory limit (a container's, a systemd unit's) budgets within it."""

from __future__ import annotations

from pathlib import Path

from fedcybgd.client.limits import enforced_budget
from fedcybgd.config import NodeConfig
from fedcybgd.core.measure import CgroupMemory, cgroup_memory, rss_bytes

MB = 2**20


def test_a_v2_limit_is_read_with_what_the_rest_of_the_group_holds(tmp_path: Path):
    # Prepare: a cgroup v2 folder as a container sees it (its own group mounted as the root)
    (tmp_path / "memory.max").write_text(f"{1536 * MB}\n")
    others = 300 * MB
    (tmp_path / "memory.stat").write_text(f"anon {rss_bytes() + others}\nfile 999999999\n")
    # Execute
    found = cgroup_memory(tmp_path)
    # Assert: the limit, and the group's anonymous memory less this process (page cache left out)
    assert found is not None and found.limit_bytes == 1536 * MB
    assert abs(found.others_bytes - others) < 64 * MB  # this process's RSS moves a little
    assert abs(found.room_mb(margin_mb=0) - (1536 - 300)) < 64


def test_a_v1_limit_is_read_and_no_limit_is_none(tmp_path: Path):
    # Prepare: v1 layout; then "max" (v2's no limit) and a v1 "unlimited" huge number
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{3 * 1024 * MB}\n")
    (tmp_path / "memory" / "memory.stat").write_text(f"total_rss {rss_bytes()}\n")
    unlimited = tmp_path / "none"
    (unlimited / "memory").mkdir(parents=True)
    (unlimited / "memory.max").write_text("max\n")
    (unlimited / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    # Execute / Assert
    found = cgroup_memory(tmp_path)
    assert found is not None and found.limit_bytes == 3 * 1024 * MB
    assert cgroup_memory(unlimited) is None


def test_the_enforced_limit_caps_or_sets_the_nodes_budget():
    limit = CgroupMemory(limit_bytes=1500 * MB, others_bytes=200 * MB)
    room = limit.room_mb()
    # no budget given: the room under the limit becomes it
    assert enforced_budget(NodeConfig(), limit).memory_budget_mb == round(room, 1)
    # a budget above the room is lowered to it; one below is kept
    assert enforced_budget(NodeConfig(memory_budget_mb=4000), limit).memory_budget_mb == round(
        room, 1)
    assert enforced_budget(NodeConfig(memory_budget_mb=900), limit).memory_budget_mb == 900
    # no limit: unchanged
    assert enforced_budget(NodeConfig(memory_budget_mb=900), None).memory_budget_mb == 900
    assert enforced_budget(NodeConfig(), None).memory_budget_mb == 0
