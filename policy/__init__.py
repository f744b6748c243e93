"""The policy: rules that rate each tool call of a plan (``models``,
``rules``), the shell parser they read commands with (``shell_words``,
``shell_commands``), what a step can reach (``baseline``), the run budgets
(``budgets``) and the rating itself (``evaluation``). Other apps ask it
through ``policy.interface``; docs/policy.md describes it."""
