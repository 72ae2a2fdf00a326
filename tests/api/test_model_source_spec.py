"""spec.model for models fetched from where they live: hf://, s3://, oci:// uris, the S3 options,
the credentials Secret and the cache; refused in one line offline and by the CRD's CEL rules alike."""
from __future__ import annotations

import re

import pytest

from shardwise.crds import names, sourcespec
from shardwise.crds.models import load_manifest
from shardwise.crds.schema import crd


def manifest(**model) -> dict:
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},
            "spec": {"model": model}}


ACCEPTED = [
    {"uri": "hf://meta-llama/Llama-3.1-8B"},
    {"uri": "hf://HuggingFaceTB/SmolLM2-135M@main", "credentialsRef": {"name": "hub-token"}},
    {"uri": "hf://TheBloke/Llama-2-7B-GGUF@a1b2c3/llama-2-7b.Q4_K_M.gguf", "format": "gguf"},
    {"uri": "s3://models/smollm2", "endpoint": "http://minio.storage:9000", "region": "us-east-1",
     "pathStyle": True, "credentialsRef": {"name": "s3-creds"}, "cache": "pod", "fetchStreams": 16},
    {"uri": "s3://my-bucket"},
    {"uri": "oci://registry.local:5000/models/smollm2:v1"},
    {"uri": "oci://ghcr.io/org/model@sha256:" + "a" * 64, "cache": "node"},
    {"uri": "pvc://weights/llama"},
    {"uri": "/models/llama"},
    {"uri": "file:///models/llama"},
]

REFUSED = [
    ({"uri": "gs://bucket/model"}, sourcespec.UNKNOWN_SCHEME),
    ({"uri": "https://example.com/model"}, sourcespec.UNKNOWN_SCHEME),
    ({"uri": "hf://just-a-name"}, "model.uri must look like hf://<org>/<name>"),
    ({"uri": "s3://B/upper"}, "model.uri must look like s3://<bucket>"),
    ({"uri": "oci://registry/repo"}, "model.uri must look like oci://<registry>/<repository>:<tag>"),
    ({"uri": "hf://org/name", "endpoint": "http://minio:9000"}, sourcespec.S3_ONLY),
    ({"uri": "oci://r/m:v1", "pathStyle": False}, sourcespec.S3_ONLY),
    ({"uri": "/models/x", "region": "eu-west-1"}, sourcespec.S3_ONLY),
    ({"uri": "hf://org/name.gguf", "format": "gguf"}, sourcespec.HF_GGUF_FILE),
    ({"uri": "s3://b/m", "endpoint": "ftp://minio:21"}, "spec.model.endpoint: String should match pattern"),
    ({"uri": "s3://b/m", "endpoint": "http://user:secret@minio:9000"},
     "spec.model.endpoint: String should match pattern"),
    ({"uri": "s3://b/m", "endpoint": "http://" + "a" * 2048}, "spec.model.endpoint: String should have at most"),
    ({"uri": "s3://b/m", "credentialsRef": {"name": "Not_A_Secret"}},
     "spec.model.credentialsRef.name: String should match pattern"),
    ({"uri": "s3://b/m", "cache": "disk"}, "spec.model.cache: Input should be 'node' or 'pod'"),
    ({"uri": "s3://b/m", "fetchStreams": 0}, "spec.model.fetchStreams: Input should be greater than or equal to 1"),
    ({"uri": "hf://org/name", "fetchStreams": 33}, "spec.model.fetchStreams: Input should be less than or equal to 32"),
    ({"uri": "pvc://weights/llama", "fetchStreams": 4}, sourcespec.REMOTE_ONLY),
]


@pytest.mark.parametrize("model", ACCEPTED)
def test_remote_and_local_sources_are_accepted_and_write_back(model):
    sm = load_manifest(manifest(**model))
    assert sm.spec.model.to_api() == {"format": "auto", **model} | ({"format": model["format"]} if "format" in model else {})


@pytest.mark.parametrize("model, message", REFUSED)
def test_bad_sources_are_refused_in_one_line(model, message):
    with pytest.raises(ValueError) as e:
        load_manifest(manifest(**model))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_remote_scheme_is_told_apart_from_paths_and_claims():
    schemes = [load_manifest(manifest(**m)).spec.model.remote_scheme() for m in ACCEPTED]
    assert schemes == ["hf", "hf", "hf", "s3", "s3", "oci", "oci", "", "", ""]


def test_every_remote_scheme_has_its_fixed_credential_keys():
    assert set(names.CREDENTIAL_ENV) == set(sourcespec.REMOTE_SCHEMES)
    every = [k for keys in names.CREDENTIAL_ENV.values() for k in keys]
    assert every == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
                     "OCI_USERNAME", "OCI_PASSWORD"]


# --- the CEL rules the API server runs, evaluated here for the form they take (string tests, has()),
# so that the API server and `shardwise plan -f` refuse the same sources with the same words.

def _python(rule: str) -> str:
    rule = re.sub(r"!has\(self\.(\w+)\)", r"('\1' not in s)", rule)
    rule = re.sub(r"has\(self\.(\w+)\)", r"('\1' in s)", rule)
    rule = re.sub(r"self\.(\w+)\.matches\(", r"_matches(s.get('\1', ''), ", rule)
    rule = re.sub(r"self\.(\w+)\.startsWith\(", r"s.get('\1', '').startswith(", rule)
    rule = re.sub(r"self\.(\w+)\.endsWith\(", r"s.get('\1', '').endswith(", rule)
    rule = rule.replace("self.format", "s.get('format', 'auto')")
    rule = rule.replace("||", " or ").replace("&&", " and ").replace("!=", "<>")
    return rule.replace("!", " not ").replace("<>", "!=")


def _cel_refusal(model: dict) -> str:
    rules = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "model"]["x-kubernetes-validations"]
    source_rules = [r for r in rules if "heads" not in r["rule"]]
    for r in source_rules:
        if not eval(_python(r["rule"]), {"_matches": lambda v, p: re.search(p, v) is not None, "s": model}):
            return r["message"]
    return ""


@pytest.mark.parametrize("model", ACCEPTED)
def test_cel_rules_accept_what_python_accepts(model):
    assert _cel_refusal({"format": "auto", **model}) == ""


@pytest.mark.parametrize("model, message", [r for r in REFUSED if not r[1].startswith("spec.")])
def test_cel_rules_refuse_with_the_same_words(model, message):
    assert message in _cel_refusal({"format": "auto", **model})


@pytest.mark.parametrize("uri,words", [
    ("s3://models/a/../b", "'..'"),
    ("hf://org/name@bad~rev", "revision"),
    ("oci://registry.local/Models/x:v1", "repository"),
])
def test_offline_the_whole_grammar_of_a_scheme_is_checked_beyond_the_api_servers_shape(uri, words):
    """The CEL rules check a uri's shape; `shardwise plan -f` also runs the uri parser, so a uri the
    pods could never fetch is refused before it is applied, in the parser's one line."""
    assert _cel_refusal({"format": "auto", "uri": uri}) == ""       # the API server's shape holds
    with pytest.raises(ValueError) as e:
        load_manifest(manifest(uri=uri))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
