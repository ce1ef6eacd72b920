"""The watcher room of the step wing: what is recorded and observed while a step runs (watch.py's lifetime,
record.py's hooks on the model, observe.py's wrapped entry points as events.py's typed events, loss_graph.py),
the job's degrees and CP group (degrees.py, group.py), and the block's exit (examine.py: agree.py through the
store, messages.py, grads.py and full_grads.py the gradients as compared), which hands the recorded group to the
judgment."""
