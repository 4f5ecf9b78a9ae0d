"""The lessons' helpers: data, models, widgets and each lesson's props, kept apart from the engine.

``kit/`` itself is the engine that runs ranks (launcher, rank bootstrap, failures, hang
reports, output, recorder, meter, trace, torchrun, magic, runner, doctor, lab, CLI). What a
lesson builds on lives here, one module per concept (data, models, sharding, resume,
precision, parallelism, proteins, molecules, graphs, profiling, moe, costmodel, widgets,
figures); each module's docstring names the lessons that use it. No task's answer lives in
either part.
"""
