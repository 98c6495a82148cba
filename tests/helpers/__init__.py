"""What the tests share, in one place: the testbed (:mod:`.testbed`: tiny model shapes, a composed
debug config), a run's files (:mod:`.runs`), the folders pytest-xdist's workers share
(:mod:`.shared`), commands in a forked process (:mod:`.cli`), the 2-process runs and their workers
(:mod:`.distributed`), test data (:mod:`.chat_formats`) and the helpers more than one test module
uses. Test modules import from here and from no other test module; conftest.py files hold
fixtures and hooks only. Nothing here is collected (no ``test_*.py``)."""
