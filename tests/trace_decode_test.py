"""tools/perfetto.py (trace_decode's reading of a trace): per-step busy time of each trace line
and each XLA:CPU line's time by kind of operation, summed by hand."""

from absl.testing import absltest

from tools.perfetto import busy_per_line, kinds_per_line


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


class KindsPerLineTest(absltest.TestCase):

  def test_self_time_per_kind_on_the_executor_lines(self):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 4, "name": "thread_name", "args": {"name": "tf_XLAEigen/9"}},
        {"ph": "M", "pid": 1, "tid": 5, "name": "thread_name", "args": {"name": "python"}},
        # the executor's wrapper spans everything below: left out
        {"ph": "X", "pid": 1, "tid": 4, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 100},
        {"ph": "X", "pid": 1, "tid": 4, "name": "ffi_call.3", "ts": 0, "dur": 10},
        {"ph": "X", "pid": 1, "tid": 4, "name": "end: ffi_call.3", "ts": 10, "dur": 1},
        # a loop of 40 us whose body holds two operations (8 + 6 us): its own time is 26
        {"ph": "X", "pid": 1, "tid": 4, "name": "while.7", "ts": 20, "dur": 40},
        {"ph": "X", "pid": 1, "tid": 4, "name": "ffi_call.12", "ts": 22, "dur": 8},
        {"ph": "X", "pid": 1, "tid": 4, "name": "copy_bitcast_fusion.2", "ts": 40, "dur": 6},
        {"ph": "X", "pid": 1, "tid": 4, "name": "copy_bitcast_fusion", "ts": 70, "dur": 4},
        {"ph": "X", "pid": 1, "tid": 5, "name": "step", "ts": 0, "dur": 500},   # not XLA's
    ]
    kinds = kinds_per_line(events, steps=2)
    self.assertEqual(list(kinds), ["/host:CPU | tf_XLAEigen/9"])
    # per step: ffi_call (10 + 8) / 2, while 26 / 2, copy_bitcast_fusion (6 + 4) / 2
    self.assertEqual(kinds["/host:CPU | tf_XLAEigen/9"],
                     {"while": [13.0, 0.5], "ffi_call": [9.0, 1.0],
                      "copy_bitcast_fusion": [5.0, 1.0]})
    self.assertEqual(list(kinds["/host:CPU | tf_XLAEigen/9"])[0], "while")   # largest first


if __name__ == "__main__":
  absltest.main()
