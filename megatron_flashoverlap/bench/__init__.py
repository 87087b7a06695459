"""Benchmark harness: emulated interconnect (netns + tbf), timing, cost model, reports."""
