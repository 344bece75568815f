"""The summary's words: for a run that trained no step (it says so, not that the config offloads nothing), for
what the kernel did in the steps (system time and minor faults against the pages moved), and for what the swap
folder's disk did in each phase of a step."""

from __future__ import annotations

import pytest

from infinity.train import disk
from infinity.train.summary import IoTotals, StepUsage, Summary, kernel_figures


def _summary(*, losses: list[float], swap_folders: list[str], kernel=None, disk_phases=None,
             moved: int = 0) -> Summary:  # fmt: skip
    io = IoTotals(read={"optimizer": moved}, written={"optimizer": moved}, blocked_s=0.0, held_nvme=4096)
    return Summary(heading="gpt2-tiny", losses=losses, first_step=4, total_s=1.0, loop_s=0.0, median_step_s=0.0,
                   tokens_per_s=0.0, peak_rss_max=1.0, peak_rss_rank0=1.0, peak_rss_sum=1.0, io=io, blocked_s_max=0.0,
                   disk_busy_s=None, swap_folders=swap_folders, checkpoint=None, kernel=kernel,
                   disk_phases=disk_phases)  # fmt: skip


def test_no_step_ran_is_not_called_no_offload():
    text = str(_summary(losses=[], swap_folders=["/swap"]))
    assert "NVMe traffic  none: no step ran" in text and "offloads nothing" not in text, text
    assert "offloads nothing to NVMe" in str(_summary(losses=[1.0], swap_folders=[]))


def test_kernel_figures_are_medians_over_the_steps_after_the_first():
    first = StepUsage(step_s=30.0, system_s=20.0, user_s=5.0, minor_faults=10**6, moved_bytes=0)  # faults in
    steps = [first] + [StepUsage(step_s=t, system_s=s, user_s=1.0, minor_faults=f, moved_bytes=4096 * 10_000)
                       for t, s, f in ((2.0, 0.5, 100), (4.0, 0.1, 300), (3.0, 0.3, 200))]  # fmt: skip
    kernel = kernel_figures(steps)
    assert (kernel.step_s, kernel.system_s, kernel.minor_faults) == (3.0, 0.3, 200)
    assert abs(kernel.system_part - 0.1) < 1e-12 and abs(kernel.faults_per_page_moved - 0.02) < 1e-12
    text = str(_summary(losses=[1.0] * 4, swap_folders=["/swap"], kernel=kernel))
    assert "0.30 s of system time a step (10% of the step" in text, text
    assert "200 minor faults a step (2.0% of the 4 KiB" in text, text
    assert "over the steps after the first" in text, text
    assert kernel_figures(steps[:1]).system_s == 20.0 and kernel_figures([]) is None  # one step: that step
    in_memory = kernel_figures([StepUsage(step_s=1.0, system_s=0.0, user_s=1.0, minor_faults=7, moved_bytes=0)])
    text = str(_summary(losses=[1.0], swap_folders=[], kernel=in_memory))
    assert "7 minor faults a step;" in text and "4 KiB pages" not in text and "over the step," in text, text


def _stat_line(sectors_read: int, sectors_written: int, busy_ms: int) -> str:
    """A block device's stat file (Documentation/admin-guide/iostats): fields 3, 7 and 10 are what DiskPhases
    reads."""
    fields = [0] * 17
    fields[2], fields[6], fields[9] = sectors_read, sectors_written, busy_ms
    return " ".join(map(str, fields)) + "\n"


def test_disk_phases_split_the_devices_counters_by_phase_and_take_medians(tmp_path, monkeypatch):
    """Each phase of a step gets what the device's counters moved while it ran (accumulation's micro-steps add
    up); the summary shows each figure's median over the steps after the first."""
    stat = tmp_path / "stat"
    stat.write_text(_stat_line(0, 0, 0))
    monkeypatch.setattr(disk, "stat_path", lambda folder: str(stat))
    phases = disk.DiskPhases("/swap")
    counters = [0, 0, 0]

    def moves(read_sectors: int, written_sectors: int, busy_ms: int) -> None:
        counters[0] += read_sectors
        counters[1] += written_sectors
        counters[2] += busy_ms
        stat.write_text(_stat_line(*counters))

    for step, scale in enumerate((100, 1, 2, 9)):  # the first step (100x) stays out of the medians
        phases.begin_step()
        for _ in range(2):  # two micro-steps
            with phases.phase("forward"):
                moves(1000 * scale, 2000 * scale, 500 * scale)
            with phases.phase("backward"):
                moves(10 * scale, 0, 5 * scale)
            with phases.phase("step"):
                pass
        assert phases.steps[-1]["forward"].read_bytes == 2 * 1000 * scale * 512, step
    medians = phases.medians()
    assert medians["forward"].read_bytes == 2 * 2000 * 512 and medians["forward"].written_bytes == 2 * 4000 * 512
    assert medians["forward"].busy_s == 2.0 and medians["backward"].busy_s == 0.02, medians
    assert medians["step"].read_bytes == 0 and medians["step"].busy_s == 0
    text = str(_summary(losses=[1.0] * 4, swap_folders=["/swap"], disk_phases=medians, moved=4096))
    assert "disk phases   forward" in text and "(0.00 GB read, 0.00 GB written, busy 0.02 s)" in text, text
    assert "medians over the steps after the first" in text and "behind the forward" not in text, text
    behind = _summary(losses=[1.0] * 4, swap_folders=["/swap"], disk_phases=medians, moved=4096)
    behind.step_behind_forward = True
    assert "the optimizer's step runs behind the forward: its I/O counts there" in str(behind)
    behind.step_behind_forward, behind.step_in_backward = False, True
    assert "the optimizer's step runs in backward: its time counts there" in str(behind)
    with pytest.raises(ValueError, match="'forwrad' is not one of"), phases.phase("forwrad"):
        pass


def test_disk_phases_say_nothing_without_a_block_device(monkeypatch):
    monkeypatch.setattr(disk, "stat_path", lambda folder: None)
    phases = disk.DiskPhases("/swap")
    phases.begin_step()
    with phases.phase("forward"):
        pass
    assert phases.medians() is None and disk.DiskPhases(None).medians() is None
    assert "disk phases" not in str(_summary(losses=[1.0], swap_folders=["/swap"], moved=4096))
