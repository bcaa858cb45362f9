"""The reward functions of examples/grpo, TRL's signature: (prompts, completions, completion_ids, **columns) ->
one float per completion. `completions` are the decoded texts (special tokens skipped); `answer` is the prompt
rows' extra column."""


def one_digit(prompts, completions, completion_ids, **columns):
    """0.5 for an answer in the format asked: exactly one digit."""
    return [0.5 if len(text) == 1 and text.isdigit() else 0.0 for text in completions]


def correct(prompts, completions, completion_ids, answer, **columns):
    """1 when the completion starts with the right sum."""
    return [1.0 if text[:1] == expected else 0.0 for text, expected in zip(completions, answer)]
