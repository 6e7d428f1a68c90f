"""tools/perfetto.py (trace_decode's reading of a trace): per-step busy time of each trace line,
summed by hand."""

from absl.testing import absltest

from tools.perfetto import busy_per_line


class BusyPerLineTest(absltest.TestCase):

  def test_sums_complete_events_per_line_and_step(self):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "head_gemv", "ts": 0, "dur": 30.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "head_gemv", "ts": 50, "dur": 34.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "norm", "ts": 40, "dur": 2.0},
        {"ph": "X", "pid": 2, "tid": 3, "name": "step", "ts": 0, "dur": 200.0},
        {"ph": "i", "pid": 2, "tid": 3, "name": "marker", "ts": 5},     # not a complete event
    ]
    lines = busy_per_line(events, steps=2, top=1)
    # the host line (200 us / 2 steps) sorts before the device line ((30 + 34 + 2) / 2)
    self.assertEqual(list(lines), ["/host:CPU | 3", "/device:GPU:0 | Stream #14"])
    self.assertEqual(lines["/host:CPU | 3"], {"us_per_step": 100.0, "top": [["step", 100.0]]})
    self.assertEqual(lines["/device:GPU:0 | Stream #14"],
                     {"us_per_step": 33.0, "top": [["head_gemv", 32.0]]})


if __name__ == "__main__":
  absltest.main()
