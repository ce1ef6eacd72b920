"""The judgment room of the step wing: a function of the recorded group. What the gradients are compared
with (baseline.py: reference.py's one-process recomputation, or the run without CP), the inputs (inputs.py,
input_layouts.py), what the events say the gradients must be (factors.py), the numbers (measure.py), the numbers read as
relations (signature.py), the rules (judge.py) and their words (diagnosis.py, remedies.py) and what a report carries besides its rows (evidence.py). It reads the watcher's data types, never
the watcher."""
