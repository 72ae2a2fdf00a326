"""model.uri's one parser: each scheme's parts, and one line for anything a store could not serve."""
import pytest

from shardwise.crds.modelsource import (HfUri, ModelUriError, OciUri, PathUri, PvcUri, S3Uri,
                                        SourceScheme, parse_model_uri)

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("uri, parsed", [
    ("/models/llama", PathUri("/models/llama")),
    ("pvc://models/llama/8b", PvcUri("models", "llama/8b")),
    ("hf://meta-llama/Llama-3.1-8B", HfUri("meta-llama/Llama-3.1-8B")),
    ("hf://HuggingFaceTB/SmolLM2-135M@main", HfUri("HuggingFaceTB/SmolLM2-135M", "main")),
    ("hf://org/name@v1.0/q4/model-Q4_K_M.gguf", HfUri("org/name", "v1.0", "q4/model-Q4_K_M.gguf")),
    ("hf://org/name/model.gguf", HfUri("org/name", None, "model.gguf")),
    # A revision ends at the first '/': what follows is a file in the repository.
    ("hf://org/name@v2/sub/x.gguf", HfUri("org/name", "v2", "sub/x.gguf")),
    ("s3://models/smollm2", S3Uri("models", "smollm2")),
    ("s3://models/a/b/", S3Uri("models", "a/b")),
    ("s3://my.bucket-1", S3Uri("my.bucket-1", "")),
    ("oci://registry.local:5000/models/smollm2:v1", OciUri("registry.local:5000", "models/smollm2", tag="v1")),
    ("oci://ghcr.io/org/model@" + DIGEST, OciUri("ghcr.io", "org/model", digest=DIGEST)),
    ("oci://localhost/m:latest", OciUri("localhost", "m", tag="latest")),
])
def test_each_scheme_parses_into_its_parts(uri, parsed):
    got = parse_model_uri(uri)
    assert got == parsed
    assert got.scheme is SourceScheme(type(parsed).scheme)


def test_parsed_remote_uris_print_as_written():
    for uri in ("hf://org/name@v1/x.gguf", "s3://models/smollm2", "oci://r.io:5000/a/b:v1",
                "oci://r.io/a@" + DIGEST):
        assert str(parse_model_uri(uri)) == uri


@pytest.mark.parametrize("uri, words", [
    ("gs://bucket/x", "scheme 'gs'"),
    ("", "empty"),
    ("s3://", "no bucket"),
    ("s3:///prefix", "no bucket"),
    ("s3://Bad_Bucket/x", "not an S3 bucket name"),
    ("s3://192.168.0.1/x", "not an S3 bucket name"),
    ("s3://models/a/../b", "'..'"),
    ("s3://models/a//b", "empty"),
    ("hf://onlyname", "hf://<org>/<name>"),
    ("hf://org/name@..x", "revision"),
    ("hf://org/name@", "revision"),
    ("hf://org/na--me", "not a Hugging Face Hub name"),
    ("hf://org/name/../x.gguf", "'..'"),
    ("hf://org/name/model.safetensors", "only a .gguf"),
    ("oci://registry/repo", "no tag or digest"),
    ("oci://registry/Repo:v1", "not an OCI repository name"),
    ("oci://registry/repo@sha256:abc", "digest"),
    ("oci://registry:99999/repo:v1", "host[:port]"),
    ("oci://registry", "oci://<registry>/<repository>:<tag>"),
    ("pvc://Claim", "pvc://<claim>/<path>"),
    ("s3://models/a b", "space"),
    ("s3://models/" + "k" * 2000, "longer than 1024"),
    ("/" + "x" * 5000, "more than 4096"),
])
def test_bad_uris_are_refused_in_one_line(uri, words):
    with pytest.raises(ModelUriError) as e:
        parse_model_uri(uri)
    message = str(e.value)
    assert words in message and "\n" not in message and len(message) < 300
