"""The summary's words: for a run that trained no step (it says so, not that the config offloads nothing), and
for what the kernel did in the steps (system time and minor faults against the pages moved)."""

from __future__ import annotations

from infinity.train.summary import IoTotals, StepUsage, Summary, kernel_figures


def _summary(*, losses: list[float], swap_folders: list[str], kernel=None) -> Summary:
    io = IoTotals(read={"optimizer": 0}, written={"optimizer": 0}, blocked_s=0.0, held_nvme=4096)
    return Summary(heading="gpt2-tiny", losses=losses, first_step=4, total_s=1.0, loop_s=0.0, median_step_s=0.0,
                   tokens_per_s=0.0, peak_rss_max=1.0, peak_rss_rank0=1.0, peak_rss_sum=1.0, io=io, blocked_s_max=0.0,
                   disk_busy_s=None, swap_folders=swap_folders, checkpoint=None, kernel=kernel)  # fmt: skip


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
