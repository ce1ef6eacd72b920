"""The command room of the step wing: how a step is run. One run (`watch_step`, `preflight(model=)`:
first.py), two runs of a function (`cpdoctor step file:fn`: request.py, probe.py, two_runs.py), two runs of the
user's own launch command (`cpdoctor step -- cmd`: command.py, command_run.py, capture.py, emulation.py)."""
