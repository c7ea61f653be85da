"""Multi-turn conversations over a :class:`Generator`, with the checkpoint's processor and chat template.

Every turn renders the whole conversation (user turns with their images, assistant replies as
text) with the checkpoint's chat template and processes it again: what transformers ``generate``
is given. The language program keeps its KV between turns, so only what follows the prefix it
already holds is prefilled (:mod:`qeff_vision.runtime.kept_prefix` for the dual deployment, the
program itself in single; the rules in :mod:`qeff_vision.runtime.retained_prefix`): the earlier
turns' tokens, and the images among them, are not prefilled again. An image shown again after
the kept prefix (or in a conversation that had to start over) comes from the per-image
embedding cache the generator owns: same preprocessed pixels, same content key, no encoder call
while the cache holds it.

Every turn is one request of the engine, run alone in slot 0
(:meth:`~qeff_vision.runtime.engine.BatchedEngine.generate`). On a language program compiled for
``full_batch_size`` > 1 (a continuous-batching artifact, which decodes only at batch
``full_batch_size``) slot 0 is a row of the batched cache, which keeps no prefix between
requests, so each turn prefills the whole conversation again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision.bad_input import check_prompt, first_line, placeholder_texts
from qeff_vision.errors import UserError
from qeff_vision.families.base import ImageSize, ModelDescription
from qeff_vision.inputs.prompt import PromptInputs, as_arrays, assistant_message, media_by_turn, user_message
from qeff_vision.inputs.sampling_params import SamplingParams
from qeff_vision.media import Clip, ImageSource, load_image, load_video
from qeff_vision.runtime.engine import compiled_slots
from qeff_vision.runtime.generator import Generator
from qeff_vision.runtime.planner import VisionProtocol
from qeff_vision.runtime.results import GenerationResult

ImageFitter = Callable[[Any], "tuple[Any, str | None]"]


class TextStream:
    """Incremental detokenization: the text each new token adds, once it is complete.

    Byte-level tokenizers can split one character over several tokens; until the rest arrives the
    decoded tail is U+FFFD, so text is released only when it does not end in one.

    Args:
        tokenizer: A transformers tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add ``token``; the newly completed text (possibly empty)."""
        self.tokens.append(int(token))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return new

    def finish(self) -> str:
        """Whatever is left undelivered (an incomplete character at the end)."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


class Conversation:
    """A chat with images whose turns share one embedding cache.

    Args:
        generator: Runs prompts; its :attr:`Generator.cache` persists across turns.
        processor: The checkpoint's processor (tokenizer, image processor, chat template).
        fit_image: Maps a loaded image to the image to use and an optional note (e.g. a resize
            to a compiled resolution); identity when None.
        protocol: Default vision protocol of :meth:`ask`.
        max_new_tokens: Default upper bound of generated tokens per turn.
        model_dir: The checkpoint directory (what a transformers reference would load), or a
            :class:`~qeff_vision.hub.HubReference` to the id and commit an export recorded.
        keep_prefix: Each turn prefills only what follows the prefix the language program holds
            from the previous one (False: the whole conversation every turn, e.g. calibration,
            which records every prompt token's activations).
        sampling: Default sampling parameters of :meth:`ask` (greedy when None).
    """

    def __init__(
        self,
        generator: Generator,
        processor,
        *,
        fit_image: ImageFitter | None = None,
        protocol: str = VisionProtocol.CHUNK.value,
        max_new_tokens: int = 32,
        model_dir: str | Path | Any = None,
        keep_prefix: bool = True,
        sampling: SamplingParams | None = None,
    ):
        self.generator = generator
        self.sampling = sampling
        self.keep_prefix = keep_prefix
        self.model_dir = Path(model_dir) if isinstance(model_dir, str) else model_dir
        self.processor = processor
        self.fit_image = fit_image
        self.protocol = protocol
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict] = []
        self.images: list[Any] = []
        self.videos: list[Clip] = []
        self.last_inputs: PromptInputs | None = None

    @property
    def cache(self):
        """The embedding cache shared by the turns."""
        return self.generator.cache

    def prepare(self, images: Sequence[ImageSource], text: str, videos: Sequence[Any] = ()) -> PromptInputs:
        """Render and process the conversation plus one new user turn (the history is unchanged).

        Raises:
            UserError: A missing or unreadable image or clip, or a clip the family cannot take.
        """
        check_prompt(text, placeholder_texts(self.processor))
        notes: list[str] = []
        new_images = []
        for source in images:
            image = load_image(source)
            if self.fit_image is not None:
                image, note = self.fit_image(image)
                if note:
                    label = source if isinstance(source, (str, Path)) else f"image {len(new_images)}"
                    notes.append(f"{label}: {note}")
            new_images.append(image)
        new_videos = [load_video(video) for video in videos]
        for clip in new_videos:
            self._check_clip(clip)
        messages = [*self.messages, user_message(len(new_images), text, len(new_videos))]
        all_images = [*self.images, *new_images]
        all_videos = [*self.videos, *new_videos]
        rendered = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        kwargs = {}
        if all_videos:
            from transformers.video_utils import VideoMetadata

            kwargs = {
                "videos": [clip.frames for clip in all_videos],
                # The frames are the clip as sampled: keep them all, time them at the clip's rate.
                "video_metadata": [
                    VideoMetadata(
                        total_num_frames=len(c.frames), fps=c.fps, frames_indices=list(range(len(c.frames)))
                    )
                    for c in all_videos
                ],
                "do_sample_frames": False,
            }
        try:
            processed = self.processor(
                text=[rendered], images=all_images or None, return_tensors="pt", **kwargs
            )
        except ValueError as exc:
            # The processor refuses a conversation's media it cannot take together (Molmo2: one
            # video per sample, so a second turn's clip): the user's input, said in one line.
            raise UserError(
                f"the conversation's {len(all_images)} image(s) and {len(all_videos)} clip(s): "
                f"{first_line(exc)} (start a new conversation for this turn's media)"
            ) from None
        return PromptInputs(messages, rendered, all_images, as_arrays(processed), notes, all_videos)

    def _check_clip(self, clip: Clip) -> None:
        """The family's clip rules (e.g. whole temporal patches) and the compiled frame counts."""
        generator = self.generator
        first = clip.frames[0]
        size = ImageSize(first.height, first.width, len(clip.frames), video=True)
        family = generator.family
        if not family.features.video.supported:
            raise UserError(
                f"{clip.source}: {family.title} does not take video ({family.features.video.note})"
            )
        if not generator.deployment.video:  # deployment single: its spec refuses vision.videos too
            raise UserError(
                f"{clip.source}: deployment single encodes images only; serve clips with deployment dual"
            )
        problems = generator.family.validate_image(ModelDescription(generator.checkpoint.config), size)
        if problems:
            raise UserError(f"{clip.source}: {problems[0]}")
        compiled = generator.compiled_vision
        if not compiled:
            return  # a bare export takes any clip
        description = ModelDescription(generator.checkpoint.config, video_processor=self._video_config())

        def fits(frames: int) -> bool:
            wanted = family.vision_symbols(
                description, ImageSize(size.height, size.width, frames, video=True)
            )
            return any(all(str(spec.get(k, v)) == str(v) for k, v in wanted.items()) for spec in compiled)

        if fits(size.frames):
            return
        shorter = [frames for frames in range(size.frames - 1, 0, -1) if fits(frames)]
        if shorter:
            raise UserError(
                f"{clip.source}: {size.frames} frames, more than the compiled clips hold at "
                f"{size.height}x{size.width} (at most {shorter[0]}; sample fewer with --fps)"
            )
        raise UserError(
            f"{clip.source}: no compiled clip specialization takes {size.frames} frames of "
            f"{size.height}x{size.width} (compile it under vision.videos)"
        )

    def _video_config(self) -> dict:
        video = getattr(self.processor, "video_processor", None)
        return video.to_dict() if video is not None else {}

    def ask(
        self,
        images: Sequence[ImageSource],
        text: str,
        *,
        videos: Sequence[Any] = (),
        max_new_tokens: int | None = None,
        protocol: str | None = None,
        on_text: Callable[[str], None] | None = None,
        keep_logits: bool = False,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """One turn: the user shows ``images`` (possibly none) and says ``text``; the model replies.

        The whole conversation is rendered again; only what follows the prefix the program holds is
        prefilled (``result.prefilled_tokens``; a note says how many were kept). The turn joins
        the history only when generation succeeds; a failed turn leaves no prefix held.

        Args:
            images: New images (paths or PIL images), placed before the text.
            text: The user's words.
            max_new_tokens: Upper bound of generated tokens (the conversation's default if None).
            protocol: ``chunk`` or ``full`` (the conversation's default if None).
            on_text: Called with each piece of reply text as soon as it is complete (streaming).
            keep_logits: Keep each step's logits row in the result.
            sampling: How tokens are chosen (the conversation's default if None).

        Returns:
            The generation result; ``text`` holds the reply, ``notes`` anything worth telling.
        """
        inputs = self.prepare(images, text, videos)
        stream = TextStream(self.processor.tokenizer)

        def on_token(token: int) -> None:
            piece = stream.push(token)
            if piece and on_text:
                on_text(piece)

        budget, protocol = max_new_tokens or self.max_new_tokens, protocol or self.protocol
        sampling = sampling or self.sampling
        result = self.generator.generate(
            inputs.processed,
            max_new_tokens=budget,
            protocol=protocol,
            on_token=on_token,
            keep_logits=keep_logits,
            keep_prefix=self.keep_prefix,
            sampling=sampling,
        )
        if self.messages and compiled_slots(self.generator) > 1:
            # Slot 0 of a continuous-batching program is a row of the batched cache (see the
            # module docstring): no prefix is kept there.
            result.notes.append(
                f"continuous batching: the whole conversation ({result.prompt_tokens} tokens) "
                "prefilled again in slot 0; no prefix is kept between turns"
            )
        rest = stream.finish()
        if rest and on_text:
            on_text(rest)
        result.text = stream.emitted
        result.notes = [*inputs.notes, *result.notes]
        self.messages = [*inputs.messages, assistant_message(result.text)]
        self.images = inputs.images
        self.videos = inputs.videos
        self.last_inputs = inputs
        return result

    def reset(self) -> None:
        """Forget the history (the embedding cache keeps its entries).

        The program still holds the last turn: the next prompt keeps only what it shares with it
        (the chat template's opening tokens, say), or starts over.
        """
        self.messages, self.images, self.videos, self.last_inputs = [], [], [], None


def open_conversation(
    artifacts_dir: str | Path,
    *,
    cache_bytes: int | None = None,
    protocol: str = VisionProtocol.CHUNK.value,
    max_new_tokens: int = 32,
    precision: str | None = None,
    video_pruning_rate: float | None = None,
    sampling: SamplingParams | None = None,
) -> Conversation:
    """A :class:`Conversation` over a compile output directory, with the checkpoint's own processor.

    Args:
        artifacts_dir: The output directory of ``qeff-vision compile`` (its manifest.json).
        cache_bytes: Bound of the per-image embedding cache (the runtime default if None).
        protocol: Default vision protocol.
        max_new_tokens: Default upper bound of generated tokens per turn.
        precision: ``fp32`` (the exported graphs) or ``device`` (fp16 as compiled, with the plan).
        video_pruning_rate: Prune clips at this rate (EVS; 0 = off) instead of the compiled spec's.
        sampling: Default sampling parameters of every turn (greedy when None).

    Raises:
        UserError: No manifest, a missing checkpoint, or a ``qaic`` artifact without the SDK runtime.
    """
    from qeff_vision.runtime.artifacts import generator_for_artifacts, image_fitter, load_artifacts
    from qeff_vision.runtime.embedding_cache import EmbeddingCache

    artifacts = load_artifacts(artifacts_dir)
    cache = EmbeddingCache(cache_bytes) if cache_bytes is not None else None
    generator = generator_for_artifacts(artifacts, cache=cache, precision=precision)
    if video_pruning_rate is not None:
        generator.set_video_pruning_rate(video_pruning_rate)
    return Conversation(
        generator,
        generator.checkpoint.processor,
        fit_image=image_fitter(artifacts),
        protocol=protocol,
        max_new_tokens=max_new_tokens,
        model_dir=artifacts.checkpoint_dir,
        sampling=sampling,
    )


@dataclass
class Turn:
    """One turn of :func:`run_turns`: the prompt, our result and, if asked, the comparison.

    Attributes:
        prompt: The user's text.
        result: Our generation (``text`` is the reply).
        comparison: Tokens against transformers generate on the same inputs, when requested.
    """

    prompt: str
    result: GenerationResult
    comparison: Any = None


def run_turns(
    chat: Conversation,
    images: Sequence[ImageSource],
    prompts: Sequence[str],
    *,
    compare_hf: bool = False,
    on_text: Callable[[str], None] | None = None,
    on_turn: Callable[[int, str], None] | None = None,
    on_done: Callable[[int, Turn], None] | None = None,
    videos: Sequence[Any] = (),
    turn_images: Mapping[int, Sequence[ImageSource]] | None = None,
    turn_videos: Mapping[int, Sequence[Any]] | None = None,
) -> list[Turn]:
    """Ask ``prompts`` in order, each with its images, optionally checking each against transformers.

    ``images`` and ``videos`` are shown in the first turn; ``turn_images`` and ``turn_videos`` map a
    turn number (1 = the first) to what that turn shows besides (after ``images`` in turn 1). A
    later turn's image is encoded in that turn and held by the program in the turns after it.
    The reference model is loaded after the first reply has streamed, so it does not delay it.

    Raises:
        UserError: A turn number outside 1..len(prompts), or what :meth:`Conversation.ask` raises.
    """
    from qeff_vision.reference import TokenComparison, load_reference_model, reference_generate_pruned

    shown_images = media_by_turn(images, turn_images, len(prompts), "image")
    shown_videos = media_by_turn(videos, turn_videos, len(prompts), "video")
    turns: list[Turn] = []
    reference = None
    for index, prompt in enumerate(prompts):
        if on_turn:
            on_turn(index, prompt)
        result = chat.ask(shown_images[index], prompt, on_text=on_text, videos=shown_videos[index])
        comparison = None
        if compare_hf:
            if chat.model_dir is None:
                raise UserError(
                    "comparing with transformers needs the checkpoint with its weights, "
                    "which is not here (OUT holds only its config, tokenizer and processor)"
                )
            if reference is None:
                reference = load_reference_model(chat.model_dir)
            processed, eos = chat.last_inputs.processed, sorted(chat.generator.eos_token_ids)
            pruned = chat.generator.prepare_prompt(processed)  # cached: the clips are not encoded again
            # transformers does not prune: a pruned prompt is given as our pruned rows and positions.
            theirs, _ = reference_generate_pruned(
                reference, chat.generator.family, processed, pruned, chat.max_new_tokens, eos
            )
            comparison = TokenComparison(tuple(result.tokens), tuple(theirs))
        turns.append(Turn(prompt, result, comparison))
        if on_done:
            on_done(index, turns[-1])
    return turns
