"""Draft kinds behind one interface (see base.Drafter)."""

from osd_jax.decoding.drafts.base import (Context, Draft, Drafter, Forced,
                                          NoDraft, Proposal, Verified,
                                          one_hot_logits)
from osd_jax.decoding.drafts.hybrid import HybridDraft
from osd_jax.decoding.drafts.model import ModelDraft
from osd_jax.decoding.drafts.ngram import NGramDraft
from osd_jax.decoding.drafts.multi import MultiDraft
from osd_jax.decoding.drafts.feature import FeatureDraft
