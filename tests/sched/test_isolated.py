"""Request templates rendered in a child process: the same text as transformers renders in this
process, a template that runs past its time stopped (and the next one rendered by a new child),
a rendering past the context's characters given back as its length."""
import pytest
from transformers import AutoTokenizer

from tandem.sched.isolated import IsolatedTemplates
from tandem.sched.llm import ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
OWN = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}assistant:"
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def child(tiny_chat_model):
    templates = IsolatedTemplates(tiny_chat_model, seconds=1.0)
    yield templates
    templates.close()


def test_a_request_template_renders_as_transformers_renders_it_here(child, tiny_chat_model):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    here = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=OWN)
    assert child.render(ChatTemplate(source=OWN, isolated=True), MESSAGES) == here
    assert here.startswith("system: Be brief." + tok.eos_token)


def test_a_template_that_runs_past_its_time_is_stopped_and_the_next_renders(child):
    child.render(ChatTemplate(source=OWN, isolated=True), MESSAGES)      # the child started
    first = child._proc
    with pytest.raises(ValueError, match="took more than 1 s to render"):
        child.render(ChatTemplate(source=LOOPS, isolated=True), MESSAGES)      # 10^10 loop turns
    assert not first.is_alive()                # killed, not left running beside the server
    assert child.render(ChatTemplate(source=OWN, isolated=True), MESSAGES).endswith("assistant:")


def test_a_failing_template_says_why_and_a_long_one_comes_back_as_its_length(child):
    with pytest.raises(ValueError, match="chat_template: does not render these messages"):
        child.render(ChatTemplate(source="{{ raise_exception('no') }}", isolated=True), MESSAGES)
    assert child.render(ChatTemplate(source="{{ 'a' * 5000 }}", isolated=True), MESSAGES, most=4999) == 5000
    assert child.render(ChatTemplate(source="{{ 'a' * 5000 }}", isolated=True), MESSAGES, most=5000) == "a" * 5000
