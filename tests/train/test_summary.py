"""The summary's words for a run that trained no step: it says so, not that the config offloads nothing."""

from __future__ import annotations

from infinity.train.summary import IoTotals, Summary


def _summary(*, losses: list[float], swap_folders: list[str]) -> Summary:
    io = IoTotals(read={"optimizer": 0}, written={"optimizer": 0}, blocked_s=0.0, held_nvme=4096)
    return Summary(heading="gpt2-tiny", losses=losses, first_step=4, total_s=1.0, loop_s=0.0, median_step_s=0.0,
                   tokens_per_s=0.0, peak_rss_max=1.0, peak_rss_rank0=1.0, peak_rss_sum=1.0, io=io, blocked_s_max=0.0,
                   disk_busy_s=None, swap_folders=swap_folders, checkpoint=None)  # fmt: skip


def test_no_step_ran_is_not_called_no_offload():
    text = str(_summary(losses=[], swap_folders=["/swap"]))
    assert "NVMe traffic  none: no step ran" in text and "offloads nothing" not in text, text
    assert "offloads nothing to NVMe" in str(_summary(losses=[1.0], swap_folders=[]))
