from tests.train.conftest import demo_assets  # noqa: F401  (the sweep tests run tiny trainings)
