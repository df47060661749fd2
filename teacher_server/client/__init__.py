"""HTTP client for RL trainers: score student candidates against a running teacher-server.

``TeacherClient`` (sync, threads) and ``AsyncTeacherClient`` (asyncio, any number of event
loops) share one surface: ``score`` returns the ``[rows, K]`` float32 matrix, ``score_full`` a
``ScoreOutput`` with the matrix and the response metadata, ``score_batch`` many requests with
bounded concurrency in input order (``return_exceptions=True`` for per-request errors), and
``score_batch_padded`` one ``[B, T, K]`` array with its row mask. Candidates always travel as
a base64 ``.npy`` int32 array (JSON lists of 8k x 256 ids are megabytes). 429/502/503/504
(honouring ``Retry-After``), connection errors and timeouts are retried with exponential
backoff and jitter; other errors raise ``TeacherServerError`` at once. Given several base URLs
(or one name resolving to many, ``resolve=True``) they route requests over the servers with the
server's own replica policy (``teacher_server.routing``) and fail over between them.

Only numpy and httpx are needed (``pip install teacher-server[client]``): nothing here imports
torch, FastAPI or uvicorn.
"""

from teacher_server.client.async_client import AsyncTeacherClient
from teacher_server.client.padding import PaddedScores, pad_scores
from teacher_server.client.protocol import (
                                            GENERATE_PATH,
                                            ScoreOutput,
                                            TeacherRequest,
                                            TeacherServerError,
                                            build_body,
                                            candidates_array,
                                            encode_candidates,
                                            parse_output,
)
from teacher_server.client.retry import RETRY_STATUSES, error_from_response, retry_after_seconds
from teacher_server.client.sync_client import TeacherClient
from teacher_server.client.tokenizer import TokenizerMismatch, check_tokenizer, fetch_model_card, tokenizer_identity
from teacher_server.client.urls import normalise_base_url

__all__ = ["TeacherClient", "AsyncTeacherClient", "TeacherRequest", "ScoreOutput", "TeacherServerError",
           "PaddedScores", "pad_scores", "RETRY_STATUSES", "GENERATE_PATH", "retry_after_seconds",
           "error_from_response", "build_body", "candidates_array", "encode_candidates", "parse_output",
           "TokenizerMismatch", "check_tokenizer", "fetch_model_card", "tokenizer_identity", "normalise_base_url"]
