"""The lessons' helpers: data, models, widgets and each lesson's props, kept apart from the engine.

``kit/`` itself is the engine that runs ranks (launcher, rank bootstrap, failures, hang
reports, output, recorder, meter, trace, torchrun, magic, runner, doctor, lab, CLI). What a
lesson builds on lives here, one module per concept: ``costmodel`` (01, 08), ``debugging``
(02), ``data`` (03), ``models`` (04-07), ``sharding`` (05), ``resume`` (06), ``precision``
(07), ``parallelism`` (08), ``proteins`` (09), ``molecules`` (10), ``graphs`` (11),
``profiling`` (12), ``moe`` (13), ``widgets`` (01, 05, 08, 09) and ``figures`` (06, 08, 09).
No task's answer lives in either part.
"""
