from nlq_scale.config.reference import render_markdown
from tests.conftest import REPO


def test_configuration_reference_is_generated_from_the_schemas():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == render_markdown(), "run: python -m nlq_scale.config.reference > docs/configuration.md"
