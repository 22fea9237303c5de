"""tools/power_cap.py's readers of nvidia-smi's samples (the GPU part runs on the device only)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import power_cap  # noqa: E402


def test_smi_lines_are_read_and_junk_is_skipped():
    stamp, mhz, watts = power_cap.parse_smi_line("2026/12/01 16:40:01.250, 1725, 638.40\n")
    assert (mhz, watts) == (1725.0, 638.4)
    assert power_cap.parse_smi_line("2026/12/01 16:40:01.500, 1980, 570.0")[0] - stamp == 0.25
    for junk in ("timestamp, clocks.current.sm [MHz], power.draw [W]", "2026/12/01 16:40:01.750, [N/A], 12.0",
                 "2026/12/01 16:40", ""):
        assert power_cap.parse_smi_line(junk) is None


def test_samples_are_averaged_over_each_labels_windows_only():
    samples = [(0.5, 1980.0, 100.0), (1.0, 1900.0, 570.0), (1.5, 1800.0, 600.0), (2.5, 1700.0, 650.0),
               (3.0, 1600.0, 660.0), (4.0, 1000.0, 50.0)]
    windows = [("a", 0.9, 1.6), ("b", 2.4, 3.1), ("a", 3.9, 3.95), ("c", 5.0, 6.0)]
    got = power_cap.clocks_by_label(samples, windows)
    assert got["a"] == (1850.0, 585.0, 2)  # the samples at 0.5 and 4.0 fall outside a's windows
    assert got["b"] == (1650.0, 655.0, 2)
    assert "c" not in got  # no sample inside: no figure rather than a made-up one
