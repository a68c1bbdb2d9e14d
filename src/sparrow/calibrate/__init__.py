"""RTPurbo calibration: retrieval-head profiling, indexer initialisation + distillation, save / load.

    profile = profile_heads(model, repeat_span_sequences(1, 4096, vocab), ratio=0.15)
    indexer, report = fit_indexer(model, profile, repeat_span_sequences(8, 4096, vocab, seed=1), steps=600)
    save_rtpurbo(checkpoint_dir, profile, indexer)
    ...
    profile, indexer = load_rtpurbo(checkpoint_dir)
    use_attention(model, rtpurbo_attention(profile, indexer, RTPurboConfig()))

``sparrow calibrate`` (:func:`main`) does the first three in one command. The files and their reader live with
the backend (:mod:`sparrow.attention.rtpurbo_io`); this package re-exports them.
"""

from sparrow.attention.rtpurbo_io import load_rtpurbo, rtpurbo_from_checkpoint, save_rtpurbo
from sparrow.calibrate.capture import capture_attention
from sparrow.calibrate.cli import main
from sparrow.calibrate.indexer import (
    HeadReport,
    IndexerReport,
    apply_indexer,
    fit_indexer,
    indexer_from_model,
    refresh_indexer,
)
from sparrow.calibrate.profile import (
    CalibrationSequence, ablation_scores, head_scores, profile_heads, repeat_span_sequences,
)

__all__ = ["capture_attention", "main", "HeadReport", "IndexerReport", "apply_indexer", "fit_indexer",
           "indexer_from_model", "refresh_indexer", "load_rtpurbo", "rtpurbo_from_checkpoint", "save_rtpurbo",
           "CalibrationSequence", "ablation_scores", "head_scores", "profile_heads", "repeat_span_sequences"]
