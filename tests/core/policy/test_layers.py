"""core.policy.layers: FSDP's layer classes and FSDP2's tied weights, found on the meta
device from the model's config (no weights read)."""

from __future__ import annotations

import json

import pytest
import torch

from core.policy import Refused, fsdp2_tied_weights_problem, fsdp_layer_classes, fsdp_wrap_classes
from tests.utils.specs import parsed_spec
from tests.utils.tiny import tiny_llama_config


def test_layer_classes_default_to_the_models_no_split_modules(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)  # config.json only: no weights exist
    assert fsdp_layer_classes(tmp_path) == ["LlamaDecoderLayer"]


def test_layer_classes_given_are_checked_against_the_model():
    requested = ["LlamaDecoderLayer", "LlamaRMSNorm"]
    assert fsdp_layer_classes(tiny_llama_config(), requested=requested) == requested


def test_layer_classes_not_in_the_model_are_refused_with_candidates():
    with pytest.raises(Refused, match="GPT2Block not found.*LlamaDecoderLayer") as e:
        fsdp_layer_classes(tiny_llama_config(), requested=["GPT2Block"])
    assert e.value.param == "distributed.fsdp.transformer_layer_cls_to_wrap"


def test_layer_classes_follow_the_task_head():
    from transformers import BertConfig, T5Config

    bert = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    t5 = T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256)
    assert fsdp_layer_classes(bert, task="seq_cls") == ["BertEmbeddings", "BertLayer"]
    assert fsdp_layer_classes(t5, task="seq2seq_lm") == ["T5Block"]


def test_layer_classes_of_an_unknown_model_type_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(Refused, match="cannot read the model config"):
        fsdp_layer_classes(tmp_path)


def test_tied_weights_beyond_the_embeddings_cannot_be_wrapped_by_fsdp2() -> None:
    from transformers import LlamaConfig, T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        t5 = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2))
        from transformers import LlamaForCausalLM

        llama = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                vocab_size=64,
                tie_word_embeddings=True,
            )
        )
    problem = fsdp2_tied_weights_problem(t5)
    assert problem is not None and "encoder.embed_tokens" in problem
    assert fsdp2_tied_weights_problem(llama) is None  # tied input/output embeddings: fine


def fsdp_spec(model: str, task: str = "causal_lm", **fsdp: object):  # type: ignore[no-untyped-def]
    return parsed_spec(model, task=task, dataset={"path": "/d", "format": "prompt_completion"},
                       distributed={"strategy": "fsdp", "num_processes": 2, "fsdp": fsdp})


def test_wrap_classes_are_none_unless_fsdp_wraps_transformer_layers(tmp_path):
    size = fsdp_spec(str(tmp_path), auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10)
    assert fsdp_wrap_classes(size, str(tmp_path), trust_remote_code=False) is None


def test_wrap_classes_default_to_the_models_layers(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    spec = fsdp_spec(str(tmp_path))
    assert fsdp_wrap_classes(spec, str(tmp_path), trust_remote_code=False) == ["LlamaDecoderLayer"]


def test_wrap_classes_named_in_the_spec_are_checked(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    spec = fsdp_spec(str(tmp_path), transformer_layer_cls_to_wrap=["GPT2Block"])
    with pytest.raises(Refused, match="GPT2Block not found") as e:
        fsdp_wrap_classes(spec, str(tmp_path), trust_remote_code=False)
    assert e.value.code == "invalid_spec"


def test_wrap_classes_of_a_model_that_is_not_there_are_model_not_found(tmp_path):
    gone = str(tmp_path / "gone")
    with pytest.raises(Refused, match="cannot read the model config") as e:
        fsdp_wrap_classes(fsdp_spec(gone), gone, trust_remote_code=False)
    assert (e.value.code, e.value.param) == ("model_not_found", "model.name_or_path")


def test_fsdp2_refuses_t5s_tied_weights_on_the_version_field(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(
        tmp_path
    )
    spec = fsdp_spec(str(tmp_path), task="seq2seq_lm", version=2)
    with pytest.raises(Refused, match="FSDP2 cannot wrap T5ForConditionalGeneration") as e:
        fsdp_wrap_classes(spec, str(tmp_path), trust_remote_code=False)
    assert e.value.param == "distributed.fsdp.version"
