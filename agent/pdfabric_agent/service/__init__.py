"""The agent as its doors see it: the ``Agent`` facade (token and cluster checks, sends,
receives, polls, aborts, the tick, a newer rank map adopted), an engine's memory registered as a
rank's (``registration``; one live engine instance per rank: ``registrants``) and live membership
(``membership``), over the rooms, ranks and peers below.
"""
