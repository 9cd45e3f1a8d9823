//! One normalized exchange per API dialect: where the prompt, the context
//! and the response live in OpenAI and Anthropic request and response bodies.
//!
//! Extraction reads a body in one pass with [`crate::json::Reader`] and
//! lists every text with its [`Scope`] and its place in the body, so the
//! guard can scan each one and rewrite only the redacted ones. Unknown shapes
//! are skipped, never an error: the body is forwarded as the client wrote
//! it. The one error besides a body that is not JSON is ambiguity: an object
//! read on the way to a text that holds a key it reads twice.
//!
//! Where what a value means depends on a member that may come after it (a
//! message's `role`, a block's `type`), the value is read where it stands
//! when that member came first, as clients write them, and otherwise
//! skipped and read again from its place once the object is read
//! ([`Reader::decided_object`]).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::LazyLock;

use aho_corasick::AhoCorasick;
use jiter::Peek;

use crate::json::{ReadError, Reader};
use crate::rules::Scope;

/// The API an endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

/// The guarded endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages`
    Messages,
}

impl Endpoint {
    /// The guarded endpoint a path names, if any: `/v1/chat/completions`
    /// and the others, after any base path, since a client reaches an API
    /// by the base URL its provider gives: `/v1`, none (DeepSeek's,
    /// Perplexity's `/chat/completions`), Gemini's `/v1beta/openai`,
    /// Azure OpenAI's `/openai/v1`, `/openai` and
    /// `/openai/deployments/{name}`, GitHub Models' `/inference`, a
    /// gateway's `/api/v1`. A guarded route reached by a path this missed
    /// would pass unguarded, so the base is not checked; only the
    /// Assistants API's messages of a thread (`/v1/threads/{id}/messages`)
    /// and the messages of a stored chat completion
    /// (`/v1/chat/completions/{id}/messages`) are other objects' parts.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        // Suffixes rather than a substring search: this runs on every
        // request, and a `str` searcher costs some 500 instructions to set
        // up.
        let path = path.trim_end_matches('/');
        let (rest, endpoint) = if let Some(rest) = path.strip_suffix("/chat/completions") {
            (rest, Endpoint::ChatCompletions)
        } else if let Some(rest) = path.strip_suffix("/completions") {
            (rest, Endpoint::Completions)
        } else if let Some(rest) = path.strip_suffix("/responses") {
            (rest, Endpoint::Responses)
        } else {
            (path.strip_suffix("/messages")?, Endpoint::Messages)
        };
        let parent = rest.rsplit('/').nth(1);
        (!matches!(parent, Some("threads" | "completions"))).then_some(endpoint)
    }

    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Messages => Dialect::Anthropic,
            _ => Dialect::OpenAi,
        }
    }

    /// A short label for metrics.
    pub fn route(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }
}

/// A text of a body: its scope, its value, and where its JSON string lies
/// in the body (quotes included), for a redaction to rewrite.
#[derive(Debug, Clone, PartialEq)]
pub struct Text<'a> {
    pub scope: Scope,
    pub text: Cow<'a, str>,
    pub span: Range<usize>,
    /// The text of something else the body carries, which a redaction
    /// could not reach (the transcript of audio), or signed text that a
    /// redaction would spoil (an Anthropic compaction's summary, which the
    /// client must send back as it came): a `redact` hit in it blocks.
    pub whole: bool,
    /// The tool definitions of a request (`tools`, `functions`): `text`
    /// is their array's JSON text as it stands at `span`, whose texts
    /// [`definition_texts`] reads; or the format its answer is to take
    /// (an object's JSON text: its schema, read as a tool's is). The model reads them as context, and
    /// they may come from a third party (an MCP server's tool list); they
    /// are sent again with every request, so the guard remembers what it
    /// found in them by their JSON text, and reads that only when it is
    /// new. Not the exchange's context: not recorded, not weighed for
    /// relevance.
    pub definition: bool,
    /// An answer's text that a request's prefill runs on into, as the
    /// client shows it (see [`RequestBody::prefill`]): Anthropic, the
    /// first content block when it is text; a chat completion, each
    /// choice's first text of its message's `content`.
    pub continues: bool,
}

impl<'a> Text<'a> {
    /// A string read from a body, as a text in `scope`.
    fn read(string: crate::json::Text<'a>, scope: Scope) -> Text<'a> {
        Text {
            scope,
            text: string.value,
            span: string.token,
            whole: false,
            definition: false,
            continues: false,
        }
    }
}

/// What the guard reads of a request body.
#[derive(Debug, Default)]
pub struct RequestBody<'a> {
    pub model: Option<Cow<'a, str>>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The `metadata` object, for [`crate::record::ClientMeta`].
    pub metadata: Option<&'a str>,
    /// System and user messages are the prompt; tool results, function
    /// outputs, documents and tool definitions are context. Assistant
    /// turns of the history are the model's own words and are not scanned
    /// again, but for a prefill.
    pub texts: Vec<Text<'a>>,
    /// The text of a last assistant turn, which the answer continues (a
    /// prefill): Anthropic's Messages API, and the chat completions of
    /// OpenAI-compatible servers that continue one (Mistral's and
    /// DeepSeek's `prefix`, vLLM's `continue_final_message`, llama.cpp,
    /// OpenRouter). The client wrote it, so it is prompt too, the last of
    /// `texts`; the client shows the answer after it, so the answer is
    /// scanned as its continuation.
    pub prefill: Option<Cow<'a, str>>,
}

impl<'a> RequestBody<'a> {
    /// Reads a request body; an error when it is not JSON, or when an
    /// object the guard reads holds one of the keys it reads twice.
    pub fn read(endpoint: Endpoint, body: &'a [u8]) -> Result<RequestBody<'a>, ReadError> {
        let mut reader = Reader::bytes(body)?;
        let read = RequestBody::read_value(&mut reader, endpoint)?;
        reader.finish()?;
        Ok(read)
    }

    /// Reads a request, the reader at its start (nothing of a value that
    /// is not an object).
    fn read_value(
        reader: &mut Reader<'a>,
        endpoint: Endpoint,
    ) -> Result<RequestBody<'a>, ReadError> {
        let mut read = RequestBody::default();
        // The system prompt, instructions and tool definitions come first
        // in `texts`, wherever the body has them: they are sent again with
        // every request, the last text is the newest.
        let (mut first, mut rest) = (Texts::default(), Texts::default());
        if reader.is_object()? {
            let keys = [
                "model",
                "stream",
                "stream_options",
                "metadata",
                "messages",
                "system",
                "prompt",
                "instructions",
                "input",
                "suffix",
                "tools",
                "functions",
                "compaction",
                "context_management",
                "response_format",
                "text",
                "output_format",
                "output_config",
            ];
            reader.object(keys, |reader, key| match (key, endpoint) {
                (0, _) => {
                    read.model = reader.string()?.map(|t| t.value);
                    Ok(())
                }
                (1, _) => {
                    read.stream = reader.boolean()? == Some(true);
                    Ok(())
                }
                (2, _) => {
                    if reader.is_object()? {
                        reader.object(["include_usage"], |reader, _| {
                            read.include_usage = reader.boolean()? == Some(true);
                            Ok(())
                        })?;
                    }
                    Ok(())
                }
                (3, _) => {
                    read.metadata = reader.object_text()?;
                    Ok(())
                }
                (4, Endpoint::ChatCompletions) => rest.chat_messages(reader),
                (4, Endpoint::Messages) => rest.anthropic_messages(reader),
                (5, Endpoint::Messages) => first.content(reader, Scope::Prompt),
                (6 | 9, Endpoint::Completions) => rest.strings(reader, Scope::Prompt),
                (6, Endpoint::Responses) => first.prompt_variables(reader),
                (7, Endpoint::Responses) => first.text(reader, Scope::Prompt),
                (8, Endpoint::Responses) => rest.responses_input(reader),
                (10, Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages)
                | (11, Endpoint::ChatCompletions) => first.definitions(reader),
                (12 | 13, Endpoint::Messages) => first.compaction_instructions(reader, key == 13),
                (14, Endpoint::ChatCompletions)
                | (15, Endpoint::Responses)
                | (16 | 17, Endpoint::Messages) => first.answer_format(reader),
                _ => reader.skip(),
            })?;
        }
        first.found.append(&mut rest.found);
        if let Some(prefill) = rest.prefill {
            read.prefill = Some(prefill.text.clone());
            first.found.push(prefill);
        }
        read.texts = first.found;
        Ok(read)
    }
}

/// Whether `path` (after the API's root: any prefix that ends with `/v1` or `/openai`) adds
/// items to a stored conversation, which a later response reads as its
/// input: `/v1/conversations` (a new one, with its first `items`) or
/// `/v1/conversations/{id}/items`.
pub fn adds_conversation_items(path: &str) -> bool {
    matches!(
        after_root(path).as_deref(),
        Some(["conversations"] | ["conversations", _, "items"])
    )
}

/// Whether `path` (after the API's root) compacts a conversation
/// (`/v1/responses/compact`): a model reads it and writes a summary of it
/// that only the API can read (an item of `encrypted_content`), which a
/// later response reads in its place. Its texts are read where it is
/// sent ([`read_compaction`]), the one place they can be.
pub fn compacts_conversation(path: &str) -> bool {
    matches!(after_root(path).as_deref(), Some(["responses", "compact"]))
}

/// Whether `path` (after the API's root) counts the tokens of a request
/// without answering it, and if so, which endpoint's request its body is:
/// Anthropic's `/v1/messages/count_tokens` and the Responses API's
/// `/v1/responses/input_tokens`. An app counts a request before it sends
/// it, so every text of the request reaches the API's servers this way
/// first: the body is read as that endpoint's request
/// ([`read_token_count`]), so that what a rule redacts or blocks does not
/// leave by this other door.
pub fn counts_tokens(path: &str) -> Option<Endpoint> {
    match after_root(path).as_deref() {
        Some(["messages", "count_tokens"]) => Some(Endpoint::Messages),
        Some(["responses", "input_tokens"]) => Some(Endpoint::Responses),
        _ => None,
    }
}

/// Reads a token count's body ([`counts_tokens`]) as a request to
/// `endpoint`; an error as for [`RequestBody::read`].
pub fn read_token_count(endpoint: Endpoint, body: &[u8]) -> Result<BatchRequest<'_>, ReadError> {
    let params = RequestBody::read(endpoint, body)?;
    Ok(BatchRequest {
        custom_id: None,
        params,
    })
}

/// The names of the texts a compaction is given ([`compacts_conversation`]),
/// read as a Responses API request's are: its `instructions` and its `input`.
pub const COMPACTED_TEXTS: [&str; 2] = ["instructions", "input"];

/// Reads a compaction's body ([`compacts_conversation`]): its
/// `instructions` and `input` ([`COMPACTED_TEXTS`]) as a Responses API
/// request's are (what tools gave the model is context), each with the
/// name of the member it is in, and its `model`.
/// An error as for [`RequestBody::read`].
pub fn read_compaction(body: &[u8]) -> Result<(BatchRequest<'_>, Vec<&'static str>), ReadError> {
    let [instructions, input] = COMPACTED_TEXTS;
    read_named(
        body,
        [instructions, input, "model"],
        |texts, reader, key| match key {
            0 => texts.text(reader, Scope::Prompt),
            _ => texts.responses_input(reader),
        },
    )
}

/// Reads a JSON body whose `keys` (at its top level; the last is
/// `model`) reach a model outside an exchange: each member but the last
/// by `read` (given its place in `keys`), and the model. The texts found,
/// with the names of the members they were found in, in the body's order.
/// An error as for [`RequestBody::read`].
fn read_named<'a, const N: usize>(
    body: &'a [u8],
    keys: [&'static str; N],
    mut read: impl FnMut(&mut Texts<'a>, &mut Reader<'a>, usize) -> Result<(), ReadError>,
) -> Result<(BatchRequest<'a>, Vec<&'static str>), ReadError> {
    let mut reader = Reader::bytes(body)?;
    let (mut texts, mut names) = (Texts::default(), Vec::new());
    let mut model = None;
    if reader.is_object()? {
        reader.object(keys, |reader, key| {
            if key == N - 1 {
                model = reader.string()?.map(|t| t.value);
                return Ok(());
            }
            let found = texts.found.len();
            read(&mut texts, reader, key)?;
            if texts.found.len() > found {
                names.push(keys[key]);
            }
            Ok(())
        })?;
    }
    reader.finish()?;
    let mut request = BatchRequest::of_texts(texts.found);
    request.params.model = model;
    Ok((request, names))
}

/// Whether `path` (after the API's root) sets up a Realtime session that
/// will not pass through here: a key for a browser to connect with
/// (`/v1/realtime/client_secrets`, the beta's `/v1/realtime/sessions` and
/// `/v1/realtime/transcription_sessions`), a WebRTC call
/// (`/v1/realtime/calls`) or the acceptance of a SIP call
/// (`/v1/realtime/calls/{id}/accept`). What it configures, its
/// instructions above all, is all of it the guard can read.
pub fn sets_up_realtime(path: &str) -> bool {
    matches!(
        after_root(path).as_deref(),
        Some(
            [
                "realtime",
                "client_secrets" | "sessions" | "transcription_sessions" | "calls"
            ] | ["realtime", "calls", _, "accept"]
        )
    )
}

/// Reads the session configuration of a request that sets up a Realtime
/// session ([`sets_up_realtime`]): its instructions and a stored prompt's
/// variables (prompt) and its tools (definitions), at the top level (a
/// call's `session` field, an acceptance, the beta's sessions) or in its
/// `session` (a client secret's). An error as for [`RequestBody::read`].
pub fn read_realtime_setup(body: &[u8]) -> Result<BatchRequest<'_>, ReadError> {
    let mut reader = Reader::bytes(body)?;
    let mut texts = Texts::default();
    let config = ["instructions", "tools", "prompt"];
    if reader.is_object()? {
        let keys = ["instructions", "tools", "prompt", "session"];
        reader.object(keys, |reader, key| match key {
            3 if reader.is_object()? => {
                reader.object(config, |reader, key| texts.realtime_config(reader, key))
            }
            3 => Ok(()),
            key => texts.realtime_config(reader, key),
        })?;
    }
    reader.finish()?;
    Ok(BatchRequest::of_texts(texts.found))
}

/// Whether a `POST` to `path` asks a model to make media from text, or to
/// transcribe audio with a text to guide it: an image
/// (`/v1/images/generations`, `/v1/images/edits`), a video (`/v1/videos`,
/// `/v1/videos/edits`, `/v1/videos/extensions`,
/// `/v1/videos/{id}/remix`), speech (`/v1/audio/speech`) or a
/// transcript (`/v1/audio/transcriptions`, `/v1/audio/translations`).
/// Azure OpenAI's classic paths name a deployment first
/// (`/openai/deployments/{name}/images/generations`). What they are told
/// to make is theirs to read ([`read_media_request`]).
pub fn makes_media(path: &str) -> bool {
    let Some(rooted) = after_root(path) else {
        return false;
    };
    let asked = match &*rooted {
        ["deployments", _, asked @ ..] => asked,
        asked => asked,
    };
    matches!(
        asked,
        ["images", "generations" | "edits"]
            | ["videos"]
            | ["videos", "edits" | "extensions"]
            | ["videos", _, "remix"]
            | ["audio", "speech" | "transcriptions" | "translations"]
    )
}

/// The names of the texts a media request gives its model
/// ([`makes_media`]): an image's, a video's or a transcript's `prompt`,
/// speech's `input` (the words spoken) and `instructions` (how). The same
/// names in a form's fields.
pub const MEDIA_TEXTS: [&str; 3] = ["prompt", "input", "instructions"];

/// Reads a media request's JSON body ([`makes_media`]): its texts
/// ([`MEDIA_TEXTS`], strings at the top level) as prompt, each with its
/// name, and its `model`. An error as for [`RequestBody::read`].
pub fn read_media_request(body: &[u8]) -> Result<(BatchRequest<'_>, Vec<&'static str>), ReadError> {
    let [prompt, input, instructions] = MEDIA_TEXTS;
    read_named(
        body,
        [prompt, input, instructions, "model"],
        |texts, reader, _| texts.text(reader, Scope::Prompt),
    )
}

/// The segments of `path` after the API's root, less a trailing slash:
/// its last `v1` or `openai` segment, whatever prefix comes before it.
/// Azure OpenAI's classic paths have no `v1` (`/openai/responses/{id}`,
/// `/openai/files/{id}/content`), nor have Gemini's
/// (`/v1beta/openai/files`); `None` when it has neither, or more segments
/// after it than any path read here has ([`ROOTED`]). Read from the end,
/// without allocating: every request that is not an exchange asks.
fn after_root(path: &str) -> Option<Rooted<'_>> {
    let mut rooted = Rooted {
        segments: [""; ROOTED],
        len: 0,
    };
    for segment in path.trim_end_matches('/').rsplit('/') {
        if matches!(segment, "v1" | "openai") {
            rooted.segments[..rooted.len].reverse();
            return Some(rooted);
        }
        *rooted.segments.get_mut(rooted.len)? = segment;
        rooted.len += 1;
    }
    None
}

/// The most segments after the API's root of a path read here
/// (`/v1/uploads/{id}/parts`: 3; `/v1/conversations/{id}/items/{id}`: 4).
const ROOTED: usize = 4;

/// The segments of a path after the API's root ([`after_root`]).
struct Rooted<'a> {
    segments: [&'a str; ROOTED],
    len: usize,
}

impl<'a> std::ops::Deref for Rooted<'a> {
    type Target = [&'a str];

    fn deref(&self) -> &[&'a str] {
        &self.segments[..self.len]
    }
}

/// Reads the `items` a request adds to a conversation, as the Responses
/// API's `input` is read; an error as for [`RequestBody::read`].
pub fn read_conversation_items(body: &[u8]) -> Result<BatchRequest<'_>, ReadError> {
    let mut reader = Reader::bytes(body)?;
    let mut texts = Texts::default();
    if reader.is_object()? {
        reader.object(["items"], |reader, _| texts.responses_input(reader))?;
    }
    reader.finish()?;
    Ok(BatchRequest::of_texts(texts.found))
}

/// What the guard reads of a client event of a Realtime API session (a
/// WebSocket text message, see `proxy::realtime`).
#[derive(Debug, Default)]
pub struct RealtimeEvent<'a> {
    /// Its `type`.
    pub kind: Option<Cow<'a, str>>,
    /// Its `event_id`, which an error about it names.
    pub event_id: Option<Cow<'a, str>>,
    /// The instructions of a `session.update` or `response.create` and
    /// the user's items of a `conversation.item.create` (`item`) or a
    /// `response.create` (`response.input`) are prompt, read as the
    /// Responses API's input items (the Realtime API's have their
    /// shape): a function call's output is context; the tools of either
    /// are definitions. The variables of a stored prompt that either
    /// names (`prompt.variables`) are prompt, as in the Responses API.
    pub texts: Vec<Text<'a>>,
}

/// Reads a Realtime API client event; an error when it is not JSON, or
/// when an object the guard reads holds one of the keys it reads twice.
/// The members are read whatever the event's type says: the API rejects
/// an event whose members its type does not have, and a member read for
/// nothing costs nothing.
pub fn read_realtime_event(body: &[u8]) -> Result<RealtimeEvent<'_>, ReadError> {
    let mut reader = Reader::bytes(body)?;
    let mut event = RealtimeEvent::default();
    let (mut first, mut rest) = (Texts::default(), Texts::default());
    if reader.is_object()? {
        let keys = ["type", "event_id", "item", "session", "response"];
        reader.object(keys, |reader, key| match key {
            0 => {
                event.kind = reader.string()?.map(|t| t.value);
                Ok(())
            }
            1 => {
                event.event_id = reader.string()?.map(|t| t.value);
                Ok(())
            }
            2 if reader.is_object()? => rest.input_item(reader),
            3 | 4 if reader.is_object()? => reader.object(
                ["instructions", "tools", "prompt", "input"],
                |reader, key| match key {
                    3 => rest.responses_input(reader),
                    key => first.realtime_config(reader, key),
                },
            ),
            _ => Ok(()),
        })?;
    }
    reader.finish()?;
    first.found.append(&mut rest.found);
    event.texts = first.found;
    Ok(event)
}

/// The texts of a request's tool definitions: their JSON text `json`
/// (of a [`Text::definition`]), which lies at `at` of the body. They are
/// the description of each tool (of a chat tool's `function` or `custom`,
/// of an MCP server in the Responses API) and every string of its
/// parameters' schema (`parameters`, `input_schema`: descriptions,
/// titles, enum values, defaults), in context, with their places in the
/// body; of an answer's format (an object), likewise its description and
/// every string of its `schema` (in a chat's `json_schema`, in a
/// `format`). Instructions hidden there reach the model as surely as in a
/// tool's result (tool poisoning). An error only for a text that is not
/// JSON.
pub fn definition_texts(json: &str, at: usize) -> Result<Vec<Text<'_>>, ReadError> {
    let mut reader = Reader::at_base(json, at);
    let mut texts = Texts::default();
    match reader.jiter.peek()? {
        // An answer's format.
        Peek::Object => texts.tool_definition(&mut reader)?,
        _ => texts.tool_definitions(&mut reader)?,
    }
    reader.finish()?;
    Ok(texts.found)
}

/// What a streamed event that carries a whole item or block holds that a
/// hosted or server tool gave the model, in context: of a Responses API
/// event, its `item` (as an output item is read, see
/// [`Texts::tool_results`]), a shell's output whole, and the pages an
/// answer's text cites (an annotation's, or a chat chunk's annotations'
/// titles, see [`Texts::annotation`]); of an Anthropic one, its `content_block`
/// when that is a server tool's result or an MCP server's tool listing,
/// and the text a `citations_delta`
/// quotes (see [`Texts::citation`]). An error as for
/// [`RequestBody::read`].
pub fn streamed_tool_results(dialect: Dialect, data: &str) -> Result<Vec<Text<'_>>, ReadError> {
    // Most items are messages and reasoning: an item of none of the tools'
    // types, as its JSON text names them, is not read.
    if dialect == Dialect::OpenAi && !TOOL_RESULT_MARKS.is_match(data) {
        return Ok(Vec::new());
    }
    let mut reader = Reader::new(data);
    let mut texts = Texts::default();
    if reader.is_object()? {
        let key = match dialect {
            Dialect::OpenAi => "item",
            Dialect::Anthropic => "content_block",
        };
        reader.object(
            [key, "delta", "output", "annotation", "choices"],
            |reader, at| {
                match (dialect, at) {
                    // A shell's output, whole in its `.done` event.
                    (Dialect::OpenAi, 2) => {
                        return texts.tool_results_in(reader, "shell_call_output");
                    }
                    // An annotation of a part's text, or of a chat answer's.
                    (Dialect::OpenAi, 3) if reader.is_object()? => return texts.annotation(reader),
                    (Dialect::OpenAi, 4) => {
                        return texts.objects(reader, |texts, reader| {
                            reader.object(["delta"], |reader, _| match reader.is_object()? {
                                true => reader
                                    .object(["annotations"], |reader, _| texts.annotations(reader)),
                                false => Ok(()),
                            })
                        });
                    }
                    _ => {}
                }
                if !reader.is_object()? {
                    return Ok(());
                }
                match (dialect, at) {
                    (Dialect::OpenAi, 0) => texts.output_item(reader),
                    (Dialect::Anthropic, 0) => reader.decided_object(
                        ["type", "content", "tools"],
                        |reader| Ok(reader.string()?.map(|t| t.value)),
                        |reader, kind, key| match key {
                            1 => texts.tool_result_content(reader, kind.as_deref()),
                            _ => texts.listed_tools(reader, kind.as_deref()),
                        },
                    ),
                    (Dialect::Anthropic, _) => {
                        reader.object(["citation"], |reader, _| texts.citation(reader))
                    }
                    _ => reader.skip(),
                }
            },
        )?;
    }
    texts.found.retain(|text| text.scope == Scope::Context);
    Ok(texts.found)
}

/// One request of an Anthropic message batch (`POST /v1/messages/batches`):
/// its `custom_id`, and its `params` read as a `/v1/messages` request, with
/// the places of the whole batch body.
#[derive(Debug)]
pub struct BatchRequest<'a> {
    pub custom_id: Option<Cow<'a, str>>,
    pub params: RequestBody<'a>,
}

impl<'a> BatchRequest<'a> {
    /// A request read for its texts alone, outside a batch (the items
    /// added to a conversation, a Realtime session's configuration).
    pub fn of_texts(texts: Vec<Text<'a>>) -> BatchRequest<'a> {
        let params = RequestBody {
            texts,
            ..RequestBody::default()
        };
        BatchRequest {
            custom_id: None,
            params,
        }
    }
}

/// Reads the requests of an Anthropic message batch; an error as for
/// [`RequestBody::read`].
pub fn read_batch(body: &[u8]) -> Result<Vec<BatchRequest<'_>>, ReadError> {
    let mut reader = Reader::bytes(body)?;
    let mut requests = Vec::new();
    if reader.is_object()? {
        reader.object(["requests"], |reader, _| {
            if !reader.is(Peek::Array)? {
                return Ok(());
            }
            reader.array(|reader| {
                let mut request = BatchRequest {
                    custom_id: None,
                    params: RequestBody::default(),
                };
                if reader.is_object()? {
                    reader.object(["custom_id", "params"], |reader, key| {
                        match key {
                            0 => request.custom_id = reader.string()?.map(|t| t.value),
                            _ => {
                                request.params =
                                    RequestBody::read_value(reader, Endpoint::Messages)?
                            }
                        }
                        Ok(())
                    })?;
                }
                requests.push(request);
                Ok(())
            })
        })?;
    }
    reader.finish()?;
    Ok(requests)
}

/// Reads one line of an OpenAI batch's input file (`custom_id`, `method`,
/// `url`, `body`): its `body` read as a request to the guarded endpoint
/// its `url` names (nothing of one that names none); an error as for
/// [`RequestBody::read`].
pub fn read_batch_input(line: &[u8]) -> Result<BatchRequest<'_>, ReadError> {
    let mut reader = Reader::bytes(line)?;
    let (mut custom_id, mut params) = (None, RequestBody::default());
    if reader.is_object()? {
        reader.decided_object(
            ["url", "custom_id", "body"],
            |reader| Ok(reader.string()?.and_then(|t| Endpoint::from_path(&t.value))),
            |reader, endpoint, key| match (key, endpoint) {
                (1, _) => {
                    custom_id = reader.string()?.map(|t| t.value);
                    Ok(())
                }
                (2, Some(endpoint)) => {
                    params = RequestBody::read_value(reader, *endpoint)?;
                    Ok(())
                }
                _ => reader.skip(),
            },
        )?;
    }
    reader.finish()?;
    Ok(BatchRequest { custom_id, params })
}

/// The answer in one line of a batch's results: an Anthropic
/// `result.message`, or the `response.body` of an OpenAI batch's output
/// file (a chat completion, completion or response, by its `object`).
#[derive(Debug)]
pub struct BatchAnswer<'a> {
    pub endpoint: Endpoint,
    /// Its texts, as [`ResponseBody::read`] finds them.
    pub texts: Vec<Text<'a>>,
    /// The model that wrote it.
    pub model: Option<Cow<'a, str>>,
    /// Its `usage` object.
    pub usage: Option<&'a str>,
}

/// One line of a batch's results, or of a file that may hold them.
#[derive(Debug)]
pub struct BatchLine<'a> {
    /// Whether the line is a batch's: an object with a `custom_id`.
    pub batch: bool,
    /// That `custom_id`, which names the batch's request it answers.
    pub custom_id: Option<Cow<'a, str>>,
    /// Its answer, if it has one (a failed or canceled request has none).
    pub answer: Option<BatchAnswer<'a>>,
}

/// Reads one line of a batch's results (JSON Lines) in `dialect`; an
/// error as for [`RequestBody::read`].
pub fn read_batch_line(dialect: Dialect, line: &[u8]) -> Result<BatchLine<'_>, ReadError> {
    let mut reader = Reader::bytes(line)?;
    let mut span = None;
    let mut custom_id = None;
    if reader.is_object()? {
        let (outer, inner) = match dialect {
            Dialect::Anthropic => ("result", "message"),
            Dialect::OpenAi => ("response", "body"),
        };
        reader.object(["custom_id", outer], |reader, key| {
            if key == 0 {
                custom_id = reader.string()?.map(|t| t.value);
                return Ok(());
            }
            if !reader.is_object()? {
                return Ok(());
            }
            reader.object([inner], |reader, _| {
                span = Some(reader.span()?);
                Ok(())
            })
        })?;
    }
    reader.finish()?;
    let answer = match span {
        Some(span) => batch_answer(&reader, dialect, span)?,
        None => None,
    };
    Ok(BatchLine {
        batch: custom_id.is_some(),
        custom_id,
        answer,
    })
}

/// The answer of a batch's line that lies at `span`, if it is one.
fn batch_answer<'a>(
    reader: &Reader<'a>,
    dialect: Dialect,
    span: Range<usize>,
) -> Result<Option<BatchAnswer<'a>>, ReadError> {
    // Its `model`, and, in an OpenAI file, its `object`, which tells the
    // endpoint.
    let (mut model, mut object) = (None, None);
    let mut part = reader.part(span.clone());
    if part.is_object()? {
        part.object(["model", "object"], |reader, key| {
            let value = reader.string()?.map(|t| t.value);
            match key {
                0 => model = value,
                _ => object = value,
            }
            Ok(())
        })?;
    }
    let endpoint = match dialect {
        Dialect::Anthropic => Some(Endpoint::Messages),
        Dialect::OpenAi => match object.as_deref() {
            Some("chat.completion") => Some(Endpoint::ChatCompletions),
            Some("text_completion") => Some(Endpoint::Completions),
            Some("response") => Some(Endpoint::Responses),
            _ => None,
        },
    };
    let Some(endpoint) = endpoint else {
        return Ok(None);
    };
    let mut part = reader.part(span);
    let mut texts = Texts::default();
    let mut usage = None;
    if part.is_object()? {
        usage = texts.answer(&mut part, endpoint)?;
    }
    Ok(Some(BatchAnswer {
        endpoint,
        texts: texts.found,
        model,
        usage,
    }))
}

/// What the guard reads of a (non-streaming) response body.
#[derive(Debug, Default)]
pub struct ResponseBody<'a> {
    /// The assistant's text, its refusal, the arguments of its tool calls
    /// and its reasoning, all in [`Scope::Response`].
    pub texts: Vec<Text<'a>>,
    /// The `usage` object.
    pub usage: Option<&'a str>,
}

impl<'a> ResponseBody<'a> {
    /// Reads a response body; an error as for [`RequestBody::read`].
    pub fn read(endpoint: Endpoint, body: &'a [u8]) -> Result<ResponseBody<'a>, ReadError> {
        let mut reader = Reader::bytes(body)?;
        let mut read = ResponseBody::default();
        let mut texts = Texts::default();
        if reader.is_object()? {
            read.usage = texts.answer(&mut reader, endpoint)?;
        }
        reader.finish()?;
        read.texts = texts.found;
        Ok(read)
    }

    /// Reads the body of a stored answer that a `GET` fetches; an error as
    /// for [`RequestBody::read`].
    pub fn read_stored(stored: Stored, body: &'a [u8]) -> Result<ResponseBody<'a>, ReadError> {
        let mut reader = Reader::bytes(body)?;
        let mut texts = Texts::default();
        if reader.is_object()? {
            match stored {
                Stored::Response => texts.answer(&mut reader, Endpoint::Responses).map(drop)?,
                Stored::ChatCompletion => texts
                    .answer(&mut reader, Endpoint::ChatCompletions)
                    .map(drop)?,
                Stored::Item => texts.stored_item(&mut reader)?,
                Stored::ChatCompletions | Stored::Items => {
                    reader.object(["data"], |reader, _| {
                        texts.objects(reader, |texts, reader| match stored {
                            Stored::Items => texts.stored_item(reader),
                            _ => texts.answer(reader, Endpoint::ChatCompletions).map(drop),
                        })
                    })?
                }
            }
        }
        reader.finish()?;
        Ok(ResponseBody {
            texts: texts.found,
            usage: None,
        })
    }
}

/// A request whose answer holds model output stored by the API (OpenAI's
/// stored responses, chat completions and conversations): read as a
/// response is, so that what the rules block when it is made cannot be
/// fetched later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// `GET /v1/responses/{id}`, and `POST /v1/responses/{id}/cancel`,
    /// which answers with the response as far as it got.
    Response,
    /// `GET /v1/chat/completions/{id}`, and `POST` there, which updates
    /// its metadata and answers with the whole completion.
    ChatCompletion,
    /// `GET /v1/chat/completions`: a list of them.
    ChatCompletions,
    /// `GET /v1/conversations/{id}/items`
    Items,
    /// `GET /v1/conversations/{id}/items/{item_id}`
    Item,
}

impl Stored {
    /// What a request of `method` to `path` answers with, if a stored
    /// answer (after the API's root: any prefix that ends with `/v1` or
    /// `/openai`).
    pub fn from_request(method: &http::Method, path: &str) -> Option<Stored> {
        let get = *method == http::Method::GET;
        let post = *method == http::Method::POST;
        match (&*after_root(path)?, get, post) {
            (["responses", _], true, _) => Some(Stored::Response),
            (["responses", _, "cancel"], _, true) => Some(Stored::Response),
            (["chat", "completions"], true, _) => Some(Stored::ChatCompletions),
            (["chat", "completions", _], true, _) | (["chat", "completions", _], _, true) => {
                Some(Stored::ChatCompletion)
            }
            (["conversations", _, "items"], true, _) => Some(Stored::Items),
            (["conversations", _, "items", _], true, _) => Some(Stored::Item),
            _ => None,
        }
    }
}

/// A request about batches, whose prompts or answers would otherwise pass
/// unread: Anthropic message batches, and the files that hold an OpenAI
/// batch's input and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batch {
    /// `POST /v1/messages/batches`: its requests are scanned as prompts.
    Create,
    /// `GET /v1/messages/batches[/{id}]`, `POST .../{id}/cancel`: batch
    /// objects, whose `results_url` must lead back through the proxy.
    Objects,
    /// `GET /v1/messages/batches/{id}/results`
    Results,
    /// `GET /v1/files/{id}/content`: a batch's output, or another file.
    FileContent,
    /// `POST /v1/files`: a batch's input (`purpose` `batch`), or another
    /// file.
    Upload,
    /// A step of a file sent in parts (the Uploads API): a batch's input,
    /// or another file.
    Parts(PartsStep),
}

/// The steps of an upload in parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartsStep {
    /// `POST /v1/uploads`
    Create,
    /// `POST /v1/uploads/{id}/parts`
    Part,
    /// `POST /v1/uploads/{id}/complete`
    Complete,
    /// `POST /v1/uploads/{id}/cancel`
    Cancel,
}

impl Batch {
    /// What a request of `method` to `path` is about, if batches (after
    /// the API's root: any prefix that ends with `/v1` or
    /// `/openai`).
    pub fn from_request(method: &http::Method, path: &str) -> Option<Batch> {
        let segments = after_root(path)?;
        let post = *method == http::Method::POST;
        let get = *method == http::Method::GET;
        match (&*segments, post, get) {
            (["messages", "batches"], true, _) => Some(Batch::Create),
            (["messages", "batches"] | ["messages", "batches", _], _, true) => Some(Batch::Objects),
            (["messages", "batches", _, "cancel"], true, _) => Some(Batch::Objects),
            (["messages", "batches", _, "results"], _, true) => Some(Batch::Results),
            (["files", _, "content"], _, true) => Some(Batch::FileContent),
            (["files"], true, _) => Some(Batch::Upload),
            (["uploads"], true, _) => Some(Batch::Parts(PartsStep::Create)),
            (["uploads", _, "parts"], true, _) => Some(Batch::Parts(PartsStep::Part)),
            (["uploads", _, "complete"], true, _) => Some(Batch::Parts(PartsStep::Complete)),
            (["uploads", _, "cancel"], true, _) => Some(Batch::Parts(PartsStep::Cancel)),
            _ => None,
        }
    }
}

/// The members of a Responses API output item that hold response text:
/// the model's words in a call (a function's or MCP tool's `arguments`, a
/// custom tool's `input`, a code interpreter's `code`), then the parts of
/// a message's `content` or a reasoning item's `summary`.
const OUTPUT_ITEM: [&str; 5] = ["arguments", "input", "code", "content", "summary"];

/// The types of Responses API items in an answer in which a hosted tool
/// gives the model something (see [`Texts::tool_results`]).
const HOSTED_TOOL_ITEMS: [&str; 5] = [
    "mcp_call",
    "mcp_list_tools",
    "file_search_call",
    "code_interpreter_call",
    "shell_call_output",
];

/// The Responses API event that carries a shell's output whole, in its
/// `output` (after the deltas of `response.shell_call_output_content.delta`).
const SHELL_OUTPUT_DONE: &str = "response.shell_call_output_content.done";

/// The names, quoted, of the items, events and annotations that carry
/// what a tool gave the model, searched in one pass over an event.
static TOOL_RESULT_MARKS: LazyLock<AhoCorasick> = LazyLock::new(|| {
    let names = HOSTED_TOOL_ITEMS
        .iter()
        .chain(&[SHELL_OUTPUT_DONE, "url_citation"]);
    match AhoCorasick::new(names.map(|name| format!("\"{name}\""))) {
        Ok(marks) => marks,
        Err(error) => unreachable!("a few short names build an automaton: {error}"),
    }
});

/// The members of a Responses API item that hold what a tool gave the
/// model (see [`Texts::tool_results`]).
const TOOL_RESULTS: [&str; 4] = ["output", "results", "outputs", "tools"];

/// Where an item's [`TOOL_RESULTS`] members lie, in their order.
type ToolResults = [Option<Range<usize>>; 4];

/// How many members of [`OUTPUT_ITEM`] are strings of text.
const OUTPUT_ITEM_STRINGS: usize = 3;

/// The texts found so far in a body.
#[derive(Default)]
struct Texts<'a> {
    found: Vec<Text<'a>>,
    /// Anthropic and chat messages: the text that ends the last message
    /// read, when that is the assistant's (see [`RequestBody::prefill`]).
    prefill: Option<Text<'a>>,
}

/// Whether a chat message's `tool_calls` or `function_call`, the reader
/// at it, calls something: any value but `null` and an empty array.
fn calls_a_tool(reader: &mut Reader) -> Result<bool, ReadError> {
    match reader.jiter.peek()? {
        Peek::Array => {
            let mut calls = false;
            reader.array(|reader| {
                calls = true;
                reader.skip()
            })?;
            Ok(calls)
        }
        peek => reader.skip().map(|()| peek != Peek::Null),
    }
}

/// Which way to read a chat message's content: the scope of its role, or
/// `None` for the model's own earlier turns. A role the API does not
/// define (`User`, `human`), or none, is read as prompt: servers that
/// take such messages give them to the model.
#[derive(Debug, Clone, Copy)]
struct RoleScope(Option<Scope>);

impl Default for RoleScope {
    fn default() -> Self {
        RoleScope(Some(Scope::Prompt))
    }
}

impl RoleScope {
    fn of(role: &str) -> RoleScope {
        RoleScope(match role {
            "assistant" => None,
            "tool" | "function" => Some(Scope::Context),
            _ => Some(Scope::Prompt),
        })
    }
}

impl<'a> Texts<'a> {
    /// What `read` finds, the first text of it marked as what a prefill
    /// runs on into ([`Text::continues`]); whether it found one.
    fn continuing(
        &mut self,
        read: impl FnOnce(&mut Self) -> Result<(), ReadError>,
    ) -> Result<bool, ReadError> {
        let first = self.found.len();
        read(self)?;
        let Some(text) = self.found.get_mut(first) else {
            return Ok(false);
        };
        text.continues = true;
        Ok(true)
    }

    /// A string value, if the next value is one.
    fn text(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        if let Some(text) = reader.string()? {
            self.found.push(Text::read(text, scope));
        }
        Ok(())
    }

    /// A string value, if the next value is one, as [`Text::whole`]: the
    /// text of something a redaction cannot reach.
    fn whole_text(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        let found = self.found.len();
        self.text(reader, scope)?;
        if let Some(text) = self.found.get_mut(found) {
            text.whole = true;
        }
        Ok(())
    }

    /// The `transcript` of an audio object (the reader at its start,
    /// anything else skipped): what the audio says, in [`Text::whole`].
    fn transcript(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if !reader.is_object()? {
            return Ok(());
        }
        reader.object(["transcript"], |reader, _| {
            self.whole_text(reader, Scope::Response)
        })
    }

    /// Each item of an array that is an object, by `object` (the reader at
    /// its start); other items, and a value that is not an array, skipped.
    fn objects(
        &mut self,
        reader: &mut Reader<'a>,
        mut object: impl FnMut(&mut Self, &mut Reader<'a>) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        if reader.is(Peek::Array)? {
            reader.array(|reader| {
                if reader.is_object()? {
                    object(self, reader)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Every string in a value, at any depth: a completion's prompt (a
    /// string, or strings in arrays), a tool's input. A key given twice is
    /// read both times, so no parser reads one unscanned.
    fn strings(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        match reader.jiter.peek()? {
            Peek::String => self.text(reader, scope),
            Peek::Array => reader.array(|reader| self.strings(reader, scope)),
            Peek::Object => reader.members(|reader| self.strings(reader, scope)),
            _ => reader.skip(),
        }
    }

    /// Tool definitions (`tools`, the deprecated `functions`), the reader
    /// at their value: an array is one [`Text::definition`], read later
    /// by [`definition_texts`] if need be.
    fn definitions(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.definition_of(reader, Peek::Array)
    }

    /// The format an answer is to take (a chat's `response_format`, the
    /// Responses API's `text`, Anthropic's `output_format` and
    /// `output_config`), the reader at its value: its schema is sent with
    /// every request, as tools are, and the model reads it as it reads a
    /// tool's; an object is one [`Text::definition`].
    fn answer_format(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.definition_of(reader, Peek::Object)
    }

    /// The next value, if of type `kind`, as one [`Text::definition`].
    fn definition_of(&mut self, reader: &mut Reader<'a>, kind: Peek) -> Result<(), ReadError> {
        if let Some((text, span)) = reader.text_of(kind)? {
            self.found.push(Text {
                scope: Scope::Context,
                text: Cow::Borrowed(text),
                span,
                whole: false,
                definition: true,
                continues: false,
            });
        }
        Ok(())
    }

    /// Each tool's definition of a list of them, the reader at the list
    /// ([`Texts::tool_definition`]).
    fn tool_definitions(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.objects(reader, |texts, reader| texts.tool_definition(reader))
    }

    /// One tool's definition, or an answer's format, the reader at its
    /// start (see [`definition_texts`]). A key given twice is read both
    /// times.
    fn tool_definition(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let keys = [
            "description",
            "server_description",
            "parameters",
            "input_schema",
            "schema",
            "function",
            "custom",
            "json_schema",
            "format",
        ];
        reader.every_member(keys, |reader, key| match key {
            0 | 1 => self.text(reader, Scope::Context),
            2..5 => self.strings(reader, Scope::Context),
            _ => match reader.is_object()? {
                true => self.tool_definition(reader),
                false => Ok(()),
            },
        })
    }

    /// OpenAI message content: a string, or parts of which the strings and
    /// the text blocks count.
    fn content(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        match reader.jiter.peek()? {
            Peek::String => self.text(reader, scope),
            Peek::Array => reader.array(|reader| match reader.jiter.peek()? {
                Peek::String => self.text(reader, scope),
                Peek::Object => self.block(reader, scope),
                _ => reader.skip(),
            }),
            _ => reader.skip(),
        }
    }

    /// Anthropic content blocks: of an array, the text blocks, tool results
    /// and documents (strings do not count).
    fn blocks(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        self.objects(reader, |texts, reader| texts.block(reader, scope))
    }

    /// A content block (Anthropic) or part (OpenAI), the reader at its
    /// start: text (`text`, `input_text`, `output_text`) in `scope`; tool
    /// results, search results and documents are context, with the title
    /// and context the model is given beside a document or search result.
    fn block(&mut self, reader: &mut Reader<'a>, scope: Scope) -> Result<(), ReadError> {
        reader.decided_object(
            ["type", "text", "content", "source", "title", "context"],
            |reader| Ok(reader.string()?.map(|t| t.value)),
            |reader, kind, key| match (kind.as_deref(), key) {
                (Some("text" | "input_text" | "output_text"), 1) => self.text(reader, scope),
                (Some("tool_result"), 2) => self.content(reader, Scope::Context),
                (Some("search_result"), 2) => self.blocks(reader, Scope::Context),
                (Some("document"), 3) => {
                    if reader.is_object()? {
                        self.document_source(reader)?;
                    }
                    Ok(())
                }
                (Some("document" | "search_result"), 4) | (Some("document"), 5) => {
                    self.text(reader, Scope::Context)
                }
                _ => reader.skip(),
            },
        )
    }

    /// The `content` of a server tool's result (Anthropic), the reader at
    /// it: a fetched page (`web_fetch_result`, its document), the output
    /// of code (`stdout`, `stderr`), a file the text editor viewed (its
    /// `content`) and the lines it wrote (`lines`), an advisor model's
    /// answer (`advisor_result`, its `text`), or web search results (an
    /// array, of which the titles: the pages' text is encrypted), all
    /// context.
    fn server_tool_result(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if reader.jiter.peek()? == Peek::Array {
            return self.objects(reader, |texts, reader| {
                reader.object(["title"], |reader, _| texts.text(reader, Scope::Context))
            });
        }
        if !reader.is_object()? {
            return Ok(());
        }
        let keys = ["content", "stdout", "stderr", "text", "lines"];
        reader.object(keys, |reader, key| match (key, reader.jiter.peek()?) {
            (0, Peek::Object) => self.block(reader, Scope::Context),
            (4, _) => self.strings(reader, Scope::Context),
            _ => self.text(reader, Scope::Context),
        })
    }

    /// What a server tool's block of type `kind` (Anthropic), other than
    /// a result, holds that the model was given, the reader at its `tools`:
    /// the tools an MCP server listed (`mcp_tool_listing`), each tool's
    /// definition, context.
    fn listed_tools(
        &mut self,
        reader: &mut Reader<'a>,
        kind: Option<&str>,
    ) -> Result<(), ReadError> {
        match kind {
            Some("mcp_tool_listing") => self.tool_definitions(reader),
            _ => reader.skip(),
        }
    }

    /// A document's `source`, the reader at its start: its `data` when its
    /// type is `text`, else the blocks of its `content`.
    fn document_source(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        reader.decided_object(
            ["type", "data", "content"],
            |reader| Ok(reader.string()?.is_some_and(|t| t.value == "text")),
            |reader, &text, key| match (key, text) {
                (1, true) => self.text(reader, Scope::Context),
                (2, false) => self.blocks(reader, Scope::Context),
                _ => reader.skip(),
            },
        )
    }

    /// OpenAI chat messages: the content of tool and function messages is
    /// context, of any but the assistant's (system, developer, user)
    /// prompt ([`RoleScope`]). Of the assistant's, the text it ends with,
    /// as [`Texts::prefill`], unless the turn calls a tool.
    fn chat_messages(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.objects(reader, |texts, reader| {
            texts.prefill = None;
            let mut calls = false;
            reader.decided_object(
                ["role", "content", "tool_calls", "function_call"],
                |reader| {
                    Ok(reader
                        .string()?
                        .map(|t| RoleScope::of(&t.value))
                        .unwrap_or_default())
                },
                |reader, scope, key| match (scope.0, key) {
                    (Some(scope), 1) => texts.content(reader, scope),
                    (None, 1) => texts.assistant_content(reader),
                    (None, _) => {
                        calls |= calls_a_tool(reader)?;
                        Ok(())
                    }
                    _ => reader.skip(),
                },
            )?;
            if calls {
                texts.prefill = None;
            }
            Ok(())
        })
    }

    /// Anthropic messages: the content of any but the assistant's, a
    /// string or blocks, is prompt (a role the API does not define too,
    /// as [`RoleScope`] says). Of the assistant's, see
    /// [`Texts::assistant_content`].
    fn anthropic_messages(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.objects(reader, |texts, reader| {
            texts.prefill = None;
            reader.decided_object(
                ["role", "content"],
                |reader| Ok(reader.string()?.is_some_and(|t| t.value == "assistant")),
                |reader, &model, _| match reader.jiter.peek()? {
                    _ if model => texts.assistant_content(reader),
                    Peek::String => texts.text(reader, Scope::Prompt),
                    _ => texts.blocks(reader, Scope::Prompt),
                },
            )
        })
    }

    /// An assistant turn's content (Anthropic, or a chat message's). Of
    /// its blocks, the results of server tools (Anthropic's web search and
    /// fetch, code execution, an advisor, an MCP connector's tools), which
    /// the API puts there: not the model's words but what it was given, so
    /// context; and the tools an MCP server listed (`mcp_tool_listing`),
    /// which later requests use as the server's tools: definitions. The
    /// rest of the turn is not read, but for the text it ends
    /// with (a string, or a last block of text), kept as
    /// [`Texts::prefill`].
    fn assistant_content(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if reader.jiter.peek()? == Peek::String {
            return self.prefill_text(reader);
        }
        self.objects(reader, |texts, reader| {
            texts.prefill = None;
            reader.decided_object(
                ["type", "content", "text", "tools"],
                |reader| Ok(reader.string()?.map(|t| t.value)),
                |reader, kind, key| match (kind.as_deref(), key) {
                    (Some("text"), 2) => texts.prefill_text(reader),
                    (kind, 1) => texts.tool_result_content(reader, kind),
                    (Some("mcp_tool_listing"), 3) => texts.definitions(reader),
                    _ => reader.skip(),
                },
            )
        })
    }

    /// The text of an assistant turn, the reader at it, as
    /// [`Texts::prefill`] (none when it is empty).
    fn prefill_text(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.prefill = reader
            .string()?
            .filter(|text| !text.value.is_empty())
            .map(|text| Text::read(text, Scope::Prompt));
        Ok(())
    }

    /// An Anthropic citation, the reader at its start: the text it quotes
    /// from a document or a web page (`cited_text`), and the title of
    /// that, are context. The client shows them beside the answer, and a
    /// web page's text reaches the client no other way unencrypted.
    fn citation(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if !reader.is_object()? {
            return Ok(());
        }
        reader.object(["cited_text", "document_title", "title"], |reader, _| {
            self.text(reader, Scope::Context)
        })
    }

    /// The `content` of an Anthropic block of type `kind`, the reader at
    /// it: context when the block is a server tool's result (see
    /// [`Texts::server_tool_result`]), else skipped.
    fn tool_result_content(
        &mut self,
        reader: &mut Reader<'a>,
        kind: Option<&str>,
    ) -> Result<(), ReadError> {
        match kind {
            Some("mcp_tool_result") => self.content(reader, Scope::Context),
            Some(kind) if kind.ends_with("_tool_result") => self.server_tool_result(reader),
            _ => reader.skip(),
        }
    }

    /// The instructions an Anthropic request gives the model that
    /// summarizes its conversation, which replace the API's own prompt for
    /// it: `compaction.instructions`, or (`edits`) the `instructions` of
    /// each of `context_management.edits`. Prompt.
    fn compaction_instructions(
        &mut self,
        reader: &mut Reader<'a>,
        edits: bool,
    ) -> Result<(), ReadError> {
        let instructions = |texts: &mut Self, reader: &mut Reader<'a>| {
            reader.object(["instructions"], |reader, _| {
                texts.text(reader, Scope::Prompt)
            })
        };
        if !reader.is_object()? {
            return Ok(());
        }
        match edits {
            true => reader.object(["edits"], |reader, _| self.objects(reader, instructions)),
            false => instructions(self, reader),
        }
    }

    /// A Realtime session's `instructions` (0), `tools` (1) or `prompt`
    /// (2), in a setup ([`read_realtime_setup`]) or an event
    /// ([`read_realtime_event`]).
    fn realtime_config(&mut self, reader: &mut Reader<'a>, key: usize) -> Result<(), ReadError> {
        match key {
            0 => self.text(reader, Scope::Prompt),
            1 => self.definitions(reader),
            _ => self.prompt_variables(reader),
        }
    }

    /// The `variables` of a Responses API prompt template (the reader at
    /// the `prompt` object): each value, a string or an input part, goes
    /// into the stored prompt, so it is prompt (apps pass the user's words
    /// this way).
    fn prompt_variables(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if !reader.is_object()? {
            return Ok(());
        }
        reader.object(["variables"], |reader, _| {
            if !reader.is_object()? {
                return Ok(());
            }
            reader.members(|reader| match reader.jiter.peek()? {
                Peek::String => self.text(reader, Scope::Prompt),
                Peek::Object => self.block(reader, Scope::Prompt),
                _ => reader.skip(),
            })
        })
    }

    /// The Responses API's `input`: a string, or items of which the
    /// outputs of tool calls (`function_call_output`, any other
    /// `*_call_output`, an `mcp_call`'s, the results of a file search,
    /// the logs of a code interpreter) are context, the tools an MCP
    /// server listed (`mcp_list_tools`) tool definitions, and the content
    /// of items other than the assistant's prompt.
    fn responses_input(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if reader.jiter.peek()? == Peek::String {
            return self.text(reader, Scope::Prompt);
        }
        self.objects(reader, Texts::input_item)
    }

    /// One input item of the Responses API (or a Realtime API
    /// conversation's item, of the same shape), the reader at its start:
    /// a message's content but the assistant's, and what a tool gave the
    /// model.
    fn input_item(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let (mut kind, mut role) = (None, None);
        let (mut content, mut found) = (None, ToolResults::default());
        let [output, results, outputs, tools] = TOOL_RESULTS;
        let keys = ["type", "role", "content", output, results, outputs, tools];
        reader.object(keys, |reader, key| {
            match key {
                0 => kind = reader.string()?.map(|t| t.value),
                1 => role = reader.string()?.map(|t| t.value),
                2 => content = Some(reader.span()?),
                _ => found[key - 3] = Some(reader.span()?),
            }
            Ok(())
        })?;
        // What a tool gave the model, given back; the tools an MCP
        // server listed are definitions.
        self.tool_results(reader, kind.as_deref(), &found, true)?;
        match content {
            Some(span) if role.as_deref() != Some("assistant") => {
                self.content(&mut reader.part(span), Scope::Prompt)
            }
            _ => Ok(()),
        }
    }

    /// The members of a response object (the reader inside it) that hold
    /// the answer, in `endpoint`'s shape; returns its `usage`.
    fn answer(
        &mut self,
        reader: &mut Reader<'a>,
        endpoint: Endpoint,
    ) -> Result<Option<&'a str>, ReadError> {
        let scope = Scope::Response;
        let mut usage = None;
        reader.object(["usage", "choices", "output", "content"], |reader, key| {
            match (key, endpoint) {
                (0, _) => usage = reader.object_text()?,
                (1, Endpoint::ChatCompletions) => self.objects(reader, |texts, reader| {
                    reader.object(["message"], |reader, _| texts.message(reader))
                })?,
                (1, Endpoint::Completions) => self.objects(reader, |texts, reader| {
                    reader.object(["text"], |reader, _| texts.text(reader, scope))
                })?,
                (2, Endpoint::Responses) => {
                    self.objects(reader, |texts, reader| texts.output_item(reader))?
                }
                // The model's text, tool input and thinking, and its
                // summary of a compacted conversation (signed: a block's
                // `content`); what a server tool gave it, and the text its
                // citations quote, context.
                (3, Endpoint::Messages) => {
                    let mut first = true;
                    self.objects(reader, |texts, reader| {
                        let first = std::mem::take(&mut first);
                        let keys = [
                            "type",
                            "text",
                            "input",
                            "thinking",
                            "content",
                            "citations",
                            "tools",
                        ];
                        reader.decided_object(
                            keys,
                            |reader| Ok(reader.string()?.map(|t| t.value)),
                            |reader, kind, key| match key {
                                1 if first && kind.as_deref() == Some("text") => texts
                                    .continuing(|texts| texts.text(reader, scope))
                                    .map(drop),
                                2 => texts.strings(reader, scope),
                                4 if kind.as_deref() == Some("compaction") => {
                                    texts.whole_text(reader, scope)
                                }
                                4 => texts.tool_result_content(reader, kind.as_deref()),
                                5 => texts.objects(reader, |texts, reader| texts.citation(reader)),
                                6 => texts.listed_tools(reader, kind.as_deref()),
                                _ => texts.text(reader, scope),
                            },
                        )
                    })?
                }
                _ => reader.skip()?,
            }
            Ok(())
        })?;
        Ok(usage)
    }

    /// A Responses API output item, the reader at its start: a call's
    /// arguments, input or code, a message's content, a reasoning item's
    /// summary and content, what a hosted tool's call tells it to do
    /// ([`Texts::call_words`]); and what a hosted tool gave the model
    /// ([`Texts::tool_results`]), context.
    fn output_item(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let [arguments, input, code, content, summary] = OUTPUT_ITEM;
        let [output, results, outputs, tools] = TOOL_RESULTS;
        let keys = [
            arguments,
            input,
            code,
            content,
            summary,
            "type",
            output,
            results,
            outputs,
            tools,
            "action",
            "operation",
            "actions",
        ];
        let (mut kind, mut found) = (None, ToolResults::default());
        reader.object(keys, |reader, key| match key {
            0..5 => self.output_member(reader, key),
            5 => {
                kind = reader.string()?.map(|t| t.value);
                Ok(())
            }
            6..10 => {
                found[key - 6] = Some(reader.span()?);
                Ok(())
            }
            10 | 11 => self.call_words(reader),
            _ => self.objects(reader, |texts, reader| texts.call_words(reader)),
        })?;
        self.tool_results(reader, kind.as_deref(), &found, false)
    }

    /// What the model's call of a hosted tool tells the tool to do (the
    /// reader at its `action` or `operation`, or at an item of a
    /// computer's `actions`): a shell's `commands` (a local shell's
    /// `command`), the `text` a computer is to type, a search's `query`,
    /// the `diff` of a patch to apply. The model's words, carried out
    /// where the client runs them: response text.
    fn call_words(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if !reader.is_object()? {
            return Ok(());
        }
        let keys = ["commands", "command", "text", "query", "diff"];
        reader.object(keys, |reader, _| self.strings(reader, Scope::Response))
    }

    /// What a Responses API item of type `kind` holds that a tool gave the
    /// model, at the places `found` of its [`TOOL_RESULTS`] members, read
    /// as context: a tool call's output (`*_call_output`, an `mcp_call`'s
    /// `output`; a shell's, each command's `stdout` and `stderr`), the
    /// text of the files a search retrieved, the logs of
    /// code run, and the tools an MCP server listed (`mcp_list_tools`):
    /// as one [`Text::definition`] when `definitions`, else text by text.
    fn tool_results(
        &mut self,
        reader: &Reader<'a>,
        kind: Option<&str>,
        found: &ToolResults,
        definitions: bool,
    ) -> Result<(), ReadError> {
        let [output, results, outputs, tools] = found.clone();
        let (kind, span) = match kind {
            Some(kind) if kind.ends_with("_call_output") || kind == "mcp_call" => (kind, output),
            Some(kind @ "file_search_call") => (kind, results),
            Some(kind @ "code_interpreter_call") => (kind, outputs),
            Some(kind @ "mcp_list_tools") => (kind, tools),
            _ => return Ok(()),
        };
        let Some(span) = span else {
            return Ok(());
        };
        let mut part = reader.part(span);
        match kind {
            "mcp_list_tools" if definitions => self.definitions(&mut part),
            kind => self.tool_results_in(&mut part, kind),
        }
    }

    /// What a tool gave the model, the reader at the member of an item of
    /// type `kind` that holds it ([`Texts::tool_results`]): context.
    fn tool_results_in(&mut self, reader: &mut Reader<'a>, kind: &str) -> Result<(), ReadError> {
        match kind {
            "mcp_list_tools" => self.tool_definitions(reader),
            "file_search_call" | "code_interpreter_call" | "shell_call_output" => {
                let keys = ["text", "logs", "stdout", "stderr"];
                self.objects(reader, |texts, reader| {
                    reader.object(keys, |reader, _| texts.text(reader, Scope::Context))
                })
            }
            _ => self.content(reader, Scope::Context),
        }
    }

    /// The member at `key` of [`OUTPUT_ITEM`] of an output item.
    fn output_member(&mut self, reader: &mut Reader<'a>, key: usize) -> Result<(), ReadError> {
        let scope = Scope::Response;
        match key {
            _ if key < OUTPUT_ITEM_STRINGS => self.text(reader, scope),
            _ => self.objects(reader, |texts, reader| {
                reader.object(
                    ["text", "refusal", "annotations"],
                    |reader, key| match key {
                        2 => texts.annotations(reader),
                        _ => texts.text(reader, scope),
                    },
                )
            }),
        }
    }

    /// The annotations of an OpenAI answer's text, the reader at their
    /// array ([`Texts::annotation`]).
    fn annotations(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        self.objects(reader, |texts, reader| texts.annotation(reader))
    }

    /// An annotation of an OpenAI answer's text, the reader at its start:
    /// the title of the web page a `url_citation` cites (the Responses
    /// API's `title`, a chat completion's `url_citation.title`). Context:
    /// the page's words, which the client shows beside the answer.
    fn annotation(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        reader.object(["title", "url_citation"], |reader, key| match key {
            0 => self.text(reader, Scope::Context),
            _ if reader.is_object()? => self.annotation(reader),
            _ => Ok(()),
        })
    }

    /// A stored conversation item, the reader at its start: read as an
    /// output item unless it is a message of another role than the
    /// assistant's (the user's own words are not the model's answer).
    fn stored_item(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let [arguments, input, code, content, summary] = OUTPUT_ITEM;
        reader.decided_object(
            ["role", arguments, input, code, content, summary],
            |reader| Ok(reader.string()?.is_some_and(|t| t.value != "assistant")),
            |reader, &not_the_model, key| match not_the_model {
                true => reader.skip(),
                false => self.output_member(reader, key - 1),
            },
        )
    }

    /// A chat answer's `content`: a string, or parts as some
    /// OpenAI-compatible servers send, of text and of Mistral's reasoning
    /// (`thinking`, a list of text parts). Its first text that is not
    /// reasoning is what a prefill runs on into.
    fn answer_content(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let scope = Scope::Response;
        let mut continued = false;
        let mut answer = |texts: &mut Self, reader: &mut Reader<'a>| match continued {
            true => texts.text(reader, scope),
            false => {
                continued = texts.continuing(|texts| texts.text(reader, scope))?;
                Ok(())
            }
        };
        if reader.jiter.peek()? != Peek::Array {
            return answer(self, reader);
        }
        reader.array(|reader| match reader.jiter.peek()? {
            Peek::Object => reader.object(["text", "thinking"], |reader, key| match key {
                0 => answer(self, reader),
                _ => self.content(reader, scope),
            }),
            Peek::String => answer(self, reader),
            _ => reader.skip(),
        })
    }

    /// An OpenAI chat completion's message: its content, its refusal, the
    /// arguments (or custom input) of its tool calls (or of the deprecated
    /// `function_call`), the transcript of its audio, and the
    /// reasoning of OpenAI-compatible servers (`reasoning_content`,
    /// `reasoning`, Mistral's `thinking` parts of the content).
    fn message(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        let scope = Scope::Response;
        if !reader.is_object()? {
            return Ok(());
        }
        reader.object(
            [
                "tool_calls",
                "audio",
                "content",
                "refusal",
                "reasoning_content",
                "reasoning",
                "function_call",
                "annotations",
            ],
            |reader, key| match key {
                7 => self.annotations(reader),
                // The deprecated functions API's one call.
                6 => match reader.is_object()? {
                    true => reader.object(["arguments"], |reader, _| self.text(reader, scope)),
                    false => Ok(()),
                },
                2 => self.answer_content(reader),
                3.. => self.text(reader, scope),
                1 => self.transcript(reader),
                _ => self.objects(reader, |texts, reader| {
                    // A function's arguments, a custom tool's input.
                    reader.object(["function", "custom"], |reader, call| {
                        if reader.is_object()? {
                            reader.object(["arguments", "input"], |reader, key| {
                                match key == call {
                                    true => texts.text(reader, scope),
                                    false => reader.skip(),
                                }
                            })?;
                        }
                        Ok(())
                    })
                }),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// The texts of `body`, read with its keys in sorted order (as `json!`
    /// writes them: a message's `content` before its `role`, a block's
    /// `text` before its `type`) and again with `role` and `type` first (as
    /// clients write them): the same either way.
    fn collect_request(endpoint: Endpoint, body: Value) -> Vec<(Scope, String)> {
        let read = |body: &str| -> Vec<(Scope, String)> {
            let read = RequestBody::read(endpoint, body.as_bytes()).unwrap();
            read.texts
                .into_iter()
                .map(|t| {
                    // Each span is the text's JSON string in the body.
                    let quoted: String = serde_json::from_str(&body[t.span.clone()]).unwrap();
                    assert_eq!(quoted, t.text);
                    (t.scope, t.text.into_owned())
                })
                .collect()
        };
        let sorted = read(&body.to_string());
        assert_eq!(sorted, read(&kind_first(&body)), "{body}");
        sorted
    }

    /// `value` as JSON with each object's `role` and `type` first.
    fn kind_first(value: &Value) -> String {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort_by_key(|k| !matches!(k.as_str(), "role" | "type"));
                let members: Vec<String> = keys
                    .iter()
                    .map(|k| format!("{}:{}", Value::from(k.as_str()), kind_first(&map[*k])))
                    .collect();
                format!("{{{}}}", members.join(","))
            }
            Value::Array(items) => {
                let items: Vec<String> = items.iter().map(kind_first).collect();
                format!("[{}]", items.join(","))
            }
            other => other.to_string(),
        }
    }

    /// The texts of `body` that are tool definitions, sorted (`json!`
    /// sorts keys).
    fn definitions(endpoint: Endpoint, body: &Value) -> Vec<String> {
        let text = body.to_string();
        let read = RequestBody::read(endpoint, text.as_bytes()).unwrap();
        let mut found = Vec::new();
        for definitions in read.texts.iter().filter(|t| t.definition) {
            assert_eq!(definitions.scope, Scope::Context);
            // The JSON text of the array, where it stands.
            assert_eq!(&text[definitions.span.clone()], definitions.text);
            for t in definition_texts(&definitions.text, definitions.span.start).unwrap() {
                let quoted: String = serde_json::from_str(&text[t.span.clone()]).unwrap();
                assert_eq!(quoted, t.text);
                assert_eq!(t.scope, Scope::Context);
                found.push(t.text.into_owned());
            }
        }
        found.sort();
        found
    }

    #[test]
    fn tool_definitions_are_context_in_every_dialect() {
        let schema = json!({"type": "object", "properties": {
            "account": {"type": "string", "description": "the account id"},
            "kind": {"enum": ["checking", "savings"], "default": "checking"}
        }, "required": ["account"]});
        let chat = json!({"model": "gpt", "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"type": "function", "function": {"name": "balance", "description": "reads a balance", "parameters": schema}},
                {"type": "custom", "custom": {"name": "sql", "description": "runs a query", "format": {"type": "text"}}}
            ],
            "functions": [{"name": "old", "description": "an old function"}]});
        assert_eq!(
            definitions(Endpoint::ChatCompletions, &chat),
            [
                "account",
                "an old function",
                "checking",
                "checking",
                "object",
                "reads a balance",
                "runs a query",
                "savings",
                "string",
                "the account id"
            ]
        );
        // Definitions come first: the user's turn is the last text.
        let text = chat.to_string();
        let read = RequestBody::read(Endpoint::ChatCompletions, text.as_bytes()).unwrap();
        let last = read.texts.last().unwrap();
        assert_eq!(
            (last.scope, &*last.text, last.definition),
            (Scope::Prompt, "hi", false)
        );

        let responses = json!({"model": "gpt", "input": "hi", "tools": [
            {"type": "function", "name": "balance", "description": "reads a balance", "parameters": {"type": "object"}},
            {"type": "mcp", "server_label": "bank", "server_url": "https://mcp.example",
                "server_description": "the bank's tools", "headers": {"Authorization": "Bearer secret"}},
            {"type": "web_search"}
        ]});
        let listed = json!({"model": "gpt", "input": [
            {"type": "mcp_list_tools", "server_label": "bank", "tools": [
                {"name": "pay", "description": "pays a bill", "input_schema": {"type": "object"}}]},
            {"role": "user", "content": "hi"}
        ]});
        assert_eq!(
            definitions(Endpoint::Responses, &listed),
            ["object", "pays a bill"]
        );
        assert_eq!(
            definitions(Endpoint::Responses, &responses),
            ["object", "reads a balance", "the bank's tools"]
        );
        let messages = json!({"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "balance", "description": "reads a balance",
                "input_schema": {"type": "object", "properties": {"account": {"description": "the account id"}}}}]});
        assert_eq!(
            definitions(Endpoint::Messages, &messages),
            ["object", "reads a balance", "the account id"]
        );
        // A key given twice is read both times (no parser reads one
        // unscanned); completions take no tools; messages' texts are not
        // definitions.
        let twice = r#"{"messages": [], "tools": [{"description": "one", "description": "two"}]}"#;
        let read = RequestBody::read(Endpoint::Messages, twice.as_bytes()).unwrap();
        let json = &read.texts[0].text;
        let texts: Vec<_> = definition_texts(json, read.texts[0].span.start).unwrap();
        assert_eq!(
            texts.iter().map(|t| &*t.text).collect::<Vec<_>>(),
            ["one", "two"]
        );
        let completions = json!({"model": "m", "prompt": "hi", "tools": [{"description": "x"}]});
        assert!(definitions(Endpoint::Completions, &completions).is_empty());
        assert!(
            definitions(
                Endpoint::Messages,
                &json!({"messages": [{"role": "user", "content": "hi"}]})
            )
            .is_empty()
        );
    }

    #[test]
    fn hosted_and_server_tool_results_given_back_are_context() {
        let anthropic = json!({"model": "claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": "find it"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "the model's words"},
                {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {"query": "q"}},
                {"type": "mcp_tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "mcp said"}]},
                {"type": "web_fetch_tool_result", "tool_use_id": "b", "content": {"type": "web_fetch_result",
                    "url": "https://example.com", "content": {"type": "document", "title": "page title",
                    "source": {"type": "text", "media_type": "text/plain", "data": "page text"}}}},
                {"type": "code_execution_tool_result", "tool_use_id": "c", "content": {
                    "type": "code_execution_result", "stdout": "out", "stderr": "err", "return_code": 0, "content": []}},
                {"type": "web_search_tool_result", "tool_use_id": "d", "content": [
                    {"type": "web_search_result", "url": "https://example.com", "title": "result title",
                        "encrypted_content": "Eq0=", "page_age": null}]},
                {"type": "text_editor_code_execution_tool_result", "tool_use_id": "e", "content": {
                    "type": "text_editor_code_execution_view_result", "content": "viewed", "file_type": "text"}},
                {"type": "text_editor_code_execution_tool_result", "tool_use_id": "f", "content": {
                    "type": "text_editor_code_execution_str_replace_result", "lines": ["written"]}},
                {"type": "advisor_tool_result", "tool_use_id": "g", "content": {
                    "type": "advisor_result", "text": "advised"}}
            ]},
        ]});
        // An assistant turn's own words are not read; what server tools
        // returned in it is (the API puts their results there).
        let mut found = collect_request(Endpoint::Messages, anthropic);
        found.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(
            found,
            [
                (Scope::Context, "advised".into()),
                (Scope::Context, "err".into()),
                (Scope::Prompt, "find it".into()),
                (Scope::Context, "mcp said".into()),
                (Scope::Context, "out".into()),
                (Scope::Context, "page text".into()),
                (Scope::Context, "page title".into()),
                (Scope::Context, "result title".into()),
                (Scope::Context, "viewed".into()),
                (Scope::Context, "written".into())
            ]
        );
        // The tools an MCP server listed, given back: the server's tools.
        let listed = json!({"messages": [{"role": "assistant", "content": [
            {"type": "mcp_tool_listing", "mcp_server_name": "m", "tools": [{"name": "t", "description": "lists"}]}
        ]}]})
        .to_string();
        let read = RequestBody::read(Endpoint::Messages, listed.as_bytes()).unwrap();
        let [tools] = &read.texts[..] else {
            panic!("{:?}", read.texts)
        };
        assert!(tools.definition, "{tools:?}");
        assert_eq!(tools.text, r#"[{"description":"lists","name":"t"}]"#);

        let responses = json!({"model": "gpt", "input": [
            {"role": "user", "content": "find it"},
            {"type": "file_search_call", "id": "f", "status": "completed", "queries": ["q"],
                "results": [{"file_id": "file_1", "filename": "a.txt", "score": 0.9, "text": "found text"}]},
            {"type": "code_interpreter_call", "id": "c", "code": "print(1)",
                "outputs": [{"type": "logs", "logs": "1"}, {"type": "image", "url": "https://x"}]},
            {"type": "file_search_call", "outputs": [{"logs": "not a search's"}]},
            {"type": "shell_call_output", "call_id": "s", "output": [
                {"stdout": "printed", "stderr": "warned", "outcome": {"type": "exit", "exit_code": 0}}]}
        ]});
        assert_eq!(
            collect_request(Endpoint::Responses, responses),
            [
                (Scope::Prompt, "find it".into()),
                (Scope::Context, "found text".into()),
                (Scope::Context, "1".into()),
                // `json!` sorts keys.
                (Scope::Context, "warned".into()),
                (Scope::Context, "printed".into())
            ]
        );
    }

    #[test]
    fn what_hosted_tools_give_the_model_in_an_answer_is_context() {
        let texts = |endpoint, body: &Value| -> Vec<(Scope, String)> {
            let text = body.to_string();
            let read = ResponseBody::read(endpoint, text.as_bytes()).unwrap();
            let mut found: Vec<_> = read
                .texts
                .into_iter()
                .map(|t| (t.scope, t.text.into_owned()))
                .collect();
            found.sort_by(|a, b| a.1.cmp(&b.1));
            found
        };
        let responses = json!({"object": "response", "output": [
            {"type": "mcp_call", "arguments": "{}", "output": "mcp said"},
            {"type": "mcp_list_tools", "tools": [{"name": "t", "description": "listed"}]},
            {"type": "file_search_call", "results": [{"text": "found"}]},
            {"type": "code_interpreter_call", "code": "print(1)", "outputs": [{"type": "logs", "logs": "logged"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "answer"}]}
        ]});
        assert_eq!(
            texts(Endpoint::Responses, &responses),
            [
                (Scope::Response, "answer".into()),
                (Scope::Context, "found".into()),
                (Scope::Context, "listed".into()),
                (Scope::Context, "logged".into()),
                (Scope::Context, "mcp said".into()),
                (Scope::Response, "print(1)".into()),
                (Scope::Response, "{}".into())
            ]
        );
        let messages = json!({"type": "message", "content": [
            {"type": "server_tool_use", "id": "s", "name": "web_fetch", "input": {"url": "u"}},
            {"type": "web_fetch_tool_result", "tool_use_id": "s", "content": {"type": "web_fetch_result",
                "content": {"type": "document", "source": {"type": "text", "data": "page"}}}},
            {"type": "text", "text": "answer"}
        ]});
        assert_eq!(
            texts(Endpoint::Messages, &messages),
            [
                (Scope::Response, "answer".into()),
                (Scope::Context, "page".into()),
                (Scope::Response, "u".into())
            ]
        );
        // Streamed, the event that carries the item or block whole.
        let found = |dialect, data: Value| -> Vec<String> {
            let data = data.to_string();
            streamed_tool_results(dialect, &data)
                .unwrap()
                .into_iter()
                .map(|t| t.text.into_owned())
                .collect()
        };
        let item = json!({"type": "response.output_item.done", "item": responses["output"][0]});
        assert_eq!(found(Dialect::OpenAi, item), ["mcp said"]);
        let block = json!({"type": "content_block_start", "index": 1, "content_block": messages["content"][1]});
        assert_eq!(found(Dialect::Anthropic, block), ["page"]);
        let text = json!({"type": "content_block_start", "index": 2, "content_block": messages["content"][2]});
        assert!(found(Dialect::Anthropic, text).is_empty());
    }

    #[test]
    fn chat_completions_prompt_and_tool_context() {
        let body = json!({"model": "gpt", "stream": true, "stream_options": {"include_usage": true}, "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "earlier answer"},
            {"role": "tool", "tool_call_id": "1", "content": "tool said"},
            {"role": "User", "content": "cased"},
            {"role": "human", "content": "other role"},
            {"content": "no role"},
            {"role": 7, "content": "odd role"}
        ]});
        let text = body.to_string();
        let read = RequestBody::read(Endpoint::ChatCompletions, text.as_bytes()).unwrap();
        assert_eq!(read.model.as_deref(), Some("gpt"));
        assert!(read.stream && read.include_usage);
        assert_eq!(
            collect_request(Endpoint::ChatCompletions, body),
            [
                (Scope::Prompt, "be nice".into()),
                (Scope::Prompt, "hi".into()),
                (Scope::Context, "tool said".into()),
                (Scope::Prompt, "cased".into()),
                (Scope::Prompt, "other role".into()),
                (Scope::Prompt, "no role".into()),
                (Scope::Prompt, "odd role".into())
            ]
        );
    }

    /// A compaction's summary is the model's text, signed: response text
    /// that a redaction cannot reach. The instructions it is written by
    /// are the client's: prompt.
    #[test]
    fn anthropic_compactions_are_read() {
        let answer = json!({"content": [
            {"type": "compaction", "content": "summed up", "encrypted_content": "opaque", "signature": "sig"},
            {"type": "compaction", "content": null},
            {"type": "text", "text": "answered"}
        ]});
        let body = answer.to_string();
        let read = ResponseBody::read(Endpoint::Messages, body.as_bytes()).unwrap();
        let texts: Vec<_> = read
            .texts
            .iter()
            .map(|t| (&*t.text, t.whole, t.scope))
            .collect();
        let response = Scope::Response;
        assert_eq!(
            texts,
            [("summed up", true, response), ("answered", false, response)]
        );

        let request = json!({"model": "claude", "messages": [{"role": "user", "content": "go on"}],
        "compaction": {"type": "summarize", "instructions": "keep the figures"},
        "context_management": {"edits": [
            {"type": "clear_tool_uses_20250919"},
            {"type": "compact_20260112", "instructions": "list the goals", "trigger": {"type": "input_tokens", "value": 50000}}
        ]}});
        assert_eq!(
            collect_request(Endpoint::Messages, request.clone()),
            [
                (Scope::Prompt, "keep the figures".into()),
                (Scope::Prompt, "list the goals".into()),
                (Scope::Prompt, "go on".into()),
            ]
        );
        // Another API's request has no such members.
        let mut chat = request;
        chat["messages"] = json!([]);
        assert!(collect_request(Endpoint::ChatCompletions, chat).is_empty());
    }

    #[test]
    fn anthropic_messages_system_tool_results_and_documents() {
        let body = json!({"model": "claude", "system": [{"type": "text", "text": "sys"}], "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "question"},
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "result"}]},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc text"}},
                {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "part"}]}},
                {"title": "doc title", "context": "doc context", "type": "document", "source": {"type": "base64", "data": "JVBERi0="}},
                {"type": "search_result", "source": "https://example.com", "title": "found",
                    "content": [{"type": "text", "text": "snippet"}], "citations": {"enabled": true}},
                {"type": "tool_result", "tool_use_id": "s", "content": [
                    {"type": "search_result", "source": "s", "title": "t", "content": [{"type": "text", "text": "nested"}]}
                ]}
            ]},
            {"role": "assistant", "content": "old"},
            {"role": "human", "content": "other role"}
        ]});
        assert_eq!(
            collect_request(Endpoint::Messages, body),
            [
                (Scope::Prompt, "sys".into()),
                (Scope::Prompt, "question".into()),
                (Scope::Context, "result".into()),
                (Scope::Context, "doc text".into()),
                (Scope::Context, "part".into()),
                // `json!` sorts keys: `type` comes last, and the members
                // before it are read after it, in the body's order.
                (Scope::Context, "doc context".into()),
                (Scope::Context, "doc title".into()),
                (Scope::Context, "snippet".into()),
                (Scope::Context, "found".into()),
                (Scope::Context, "nested".into()),
                (Scope::Context, "t".into()),
                (Scope::Prompt, "other role".into())
            ]
        );
    }

    #[test]
    /// The text that ends a last assistant turn is a prefill: prompt, and
    /// kept as what the answer continues; an earlier turn's is not read.
    fn anthropic_prefill_is_the_text_a_last_assistant_turn_ends_with() {
        let prefill = |messages: Value| {
            let body = json!({"model": "claude", "messages": messages}).to_string();
            let read = RequestBody::read(Endpoint::Messages, body.as_bytes()).unwrap();
            let texts = read
                .texts
                .iter()
                .map(|t| t.text.to_string())
                .collect::<Vec<_>>();
            (read.prefill.map(String::from), texts)
        };
        let asked = json!({"role": "user", "content": "asked"});
        assert_eq!(
            prefill(json!([asked, {"role": "assistant", "content": "Sure, the"}])),
            (
                Some("Sure, the".into()),
                vec!["asked".into(), "Sure, the".into()]
            )
        );
        let blocks = json!({"role": "assistant", "content": [
            {"type": "text", "text": "first"},
            {"type": "web_fetch_tool_result", "tool_use_id": "f", "content": {"type": "web_fetch_result", "content": {"type": "document", "source": {"type": "text", "data": "page"}}}},
            {"type": "text", "text": "Then \"the"}
        ]});
        assert_eq!(
            prefill(json!([asked, blocks])),
            (
                Some("Then \"the".into()),
                vec!["asked".into(), "page".into(), "Then \"the".into()]
            )
        );
        // Not a prefill: a turn that does not end with text, an earlier
        // turn, an empty one.
        let call = json!({"role": "assistant", "content": [
            {"type": "text", "text": "calling"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}
        ]});
        assert_eq!(prefill(json!([asked, call])), (None, vec!["asked".into()]));
        let earlier = json!({"role": "assistant", "content": "earlier"});
        assert_eq!(
            prefill(json!([earlier, asked])),
            (None, vec!["asked".into()])
        );
        let empty = json!({"role": "assistant", "content": ""});
        assert_eq!(prefill(json!([asked, empty])), (None, vec!["asked".into()]));
    }

    #[test]
    /// A chat completion's last assistant message is a prefill too, for
    /// the servers that continue one, unless it calls a tool.
    fn chat_prefill_is_the_text_a_last_assistant_message_ends_with() {
        let prefill = |messages: Value| {
            let body = json!({"model": "mistral-large", "messages": messages});
            let [sorted, kind_first] = [body.to_string(), kind_first(&body)].map(|body| {
                let read = RequestBody::read(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
                let texts = read.texts.iter().map(|t| t.text.to_string());
                (read.prefill.map(String::from), texts.collect::<Vec<_>>())
            });
            assert_eq!(sorted, kind_first, "{messages}");
            sorted
        };
        let some = |prefill: &str| {
            (
                Some(prefill.to_owned()),
                vec!["asked".into(), prefill.into()],
            )
        };
        let none = (None, vec!["asked".to_owned()]);
        let asked = json!({"role": "user", "content": "asked"});
        let said = |turn: Value| json!([asked, turn]);
        let parts =
            json!([{"type": "text", "text": "first"}, {"type": "text", "text": "Then the"}]);
        let call =
            json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
        let refused = json!([{"type": "text", "text": "x"}, {"type": "refusal", "refusal": "no"}]);
        let cases = [
            (
                json!({"role": "assistant", "content": "Sure, the", "prefix": true}),
                some("Sure, the"),
            ),
            (
                json!({"role": "assistant", "content": parts}),
                some("Then the"),
            ),
            (
                json!({"role": "assistant", "content": "So", "tool_calls": []}),
                some("So"),
            ),
            (
                json!({"role": "assistant", "content": "So", "tool_calls": null}),
                some("So"),
            ),
            // Not a prefill: a message that calls a tool (or a function),
            // one that ends with a refusal, an empty one.
            (
                json!({"role": "assistant", "content": "calling", "tool_calls": call}),
                none.clone(),
            ),
            (
                json!({"role": "assistant", "content": "calling", "function_call": {"name": "f", "arguments": "{}"}}),
                none.clone(),
            ),
            (
                json!({"role": "assistant", "content": refused}),
                none.clone(),
            ),
            (json!({"role": "assistant", "content": ""}), none.clone()),
        ];
        for (turn, expected) in cases {
            assert_eq!(prefill(said(turn.clone())), expected, "{turn}");
        }
        // Nor an earlier message.
        let earlier = json!({"role": "assistant", "content": "earlier"});
        assert_eq!(prefill(json!([earlier, asked])), none);
    }

    #[test]
    /// What a prefill runs on into: each choice's first text of its
    /// message's content (not its reasoning, nor a call's arguments), and
    /// an Anthropic answer's first block when that is text.
    fn the_texts_a_prefill_continues() {
        let continued = |endpoint, body: Value| {
            let body = body.to_string();
            let read = ResponseBody::read(endpoint, body.as_bytes()).unwrap();
            let texts = read.texts.iter().map(|t| (t.text.to_string(), t.continues));
            texts.collect::<Vec<_>>()
        };
        let text = |text: &str, continues| (text.to_owned(), continues);
        let call = json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]);
        let chat = json!({"choices": [
            {"index": 0, "message": {"role": "assistant", "content": "one", "reasoning_content": "think"}},
            {"index": 1, "message": {"role": "assistant", "tool_calls": call, "content": [
                {"type": "text", "text": "two"}, {"type": "text", "text": "more"}
            ]}},
        ]});
        assert_eq!(
            continued(Endpoint::ChatCompletions, chat),
            [
                text("one", true),
                text("think", false),
                text("two", true),
                text("more", false),
                text("{\"a\":1}", false)
            ]
        );
        // Mistral's reasoning comes first, in parts of its own.
        let thought = json!({"type": "thinking", "thinking": [{"type": "text", "text": "weigh"}]});
        let mistral = json!({"choices": [{"message": {"content": [thought, {"type": "text", "text": "answer"}]}}]});
        assert_eq!(
            continued(Endpoint::ChatCompletions, mistral),
            [text("weigh", false), text("answer", true)]
        );
        // A part of no text continues nothing.
        let empty = json!({"type": "text", "text": null});
        let mistral = json!({"choices": [{"message": {"content": [empty, thought, {"type": "text", "text": "answer"}]}}]});
        assert_eq!(
            continued(Endpoint::ChatCompletions, mistral),
            [text("weigh", false), text("answer", true)]
        );
        let blocks = |first: Value| json!({"content": [first, {"type": "text", "text": "after"}], "stop_reason": "end_turn"});
        let first_text = blocks(json!({"type": "text", "text": "runs on"}));
        assert_eq!(
            continued(Endpoint::Messages, first_text),
            [text("runs on", true), text("after", false)]
        );
        let first_call =
            blocks(json!({"type": "tool_use", "id": "t", "name": "f", "input": {"q": "x"}}));
        assert_eq!(
            continued(Endpoint::Messages, first_call),
            [text("x", false), text("after", false)]
        );
    }

    #[test]
    fn responses_and_completions_inputs() {
        let body = json!({"instructions": "inst", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "mine"}]},
            {"type": "function_call_output", "call_id": "c", "output": "out"},
            {"type": "custom_tool_call_output", "call_id": "d", "output": [{"type": "input_text", "text": "custom"}]},
            {"type": "local_shell_call_output", "id": "e", "output": "shell"},
            {"type": "mcp_call", "name": "f", "arguments": "{}", "output": "mcp"},
            {"type": "computer_call_output", "call_id": "g", "output": {"type": "computer_screenshot", "image_url": "data:"}}
        ]});
        assert_eq!(
            collect_request(Endpoint::Responses, body),
            [
                (Scope::Prompt, "inst".into()),
                (Scope::Prompt, "q".into()),
                (Scope::Context, "out".into()),
                (Scope::Context, "custom".into()),
                (Scope::Context, "shell".into()),
                (Scope::Context, "mcp".into())
            ]
        );
        let body = json!({"prompt": {"id": "pmpt_1", "version": "2", "variables": {
                "city": "Lyon", "question": {"type": "input_text", "text": "asked"},
                "photo": {"type": "input_image", "image_url": "https://example.com/a.png"}}},
            "input": "more"});
        assert_eq!(
            collect_request(Endpoint::Responses, body),
            [
                (Scope::Prompt, "Lyon".into()),
                (Scope::Prompt, "asked".into()),
                (Scope::Prompt, "more".into())
            ]
        );
        let body = json!({"prompt": "before", "suffix": "after"});
        assert_eq!(
            collect_request(Endpoint::Completions, body),
            [
                (Scope::Prompt, "before".into()),
                (Scope::Prompt, "after".into())
            ]
        );
        let body = json!({"prompt": ["a", ["b"], 7]});
        assert_eq!(
            collect_request(Endpoint::Completions, body),
            [(Scope::Prompt, "a".into()), (Scope::Prompt, "b".into())]
        );
    }

    #[test]
    fn ambiguous_or_broken_bodies_are_errors_and_odd_shapes_are_skipped() {
        let twice = br#"{"messages": [{"role": "user", "content": "a", "content": "b"}]}"#;
        assert!(RequestBody::read(Endpoint::ChatCompletions, twice).is_err());
        assert!(RequestBody::read(Endpoint::ChatCompletions, b"{\"messages\": [").is_err());
        for odd in [
            &b"[1, 2]"[..],
            b"\"text\"",
            b"{\"messages\": {\"role\": \"user\"}}",
            b"{\"messages\": [null, 3, {\"role\": 1}]}",
        ] {
            let read = RequestBody::read(Endpoint::ChatCompletions, odd).unwrap();
            assert!(read.texts.is_empty());
        }
    }

    /// A body nested a hundred thousand deep, where the guard reads it or
    /// where it skips it, is an error: never a stack overflow, which would
    /// take the whole proxy down.
    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        use crate::json::MAX_DEPTH;
        let deep = |depth: usize| format!("{}\"x\"{}", "[".repeat(depth), "]".repeat(depth));
        let prompt = |depth| format!(r#"{{"model": "m", "prompt": {}}}"#, deep(depth));
        // The prompt sits one level down, in the body's object.
        let within = prompt(MAX_DEPTH - 1);
        let read = RequestBody::read(Endpoint::Completions, within.as_bytes());
        assert_eq!(read.unwrap().texts[0].text, "x");
        for depth in [MAX_DEPTH, 100_000] {
            let body = prompt(depth);
            let read = RequestBody::read(Endpoint::Completions, body.as_bytes());
            assert!(matches!(read, Err(ReadError::Invalid(_))), "{depth}");
        }
        let skipped = format!(
            r#"{{"model": "m", "x": {}, "messages": []}}"#,
            deep(100_000)
        );
        // jiter bounds what it skips itself.
        let read = RequestBody::read(Endpoint::ChatCompletions, skipped.as_bytes());
        assert!(matches!(read, Err(ReadError::Invalid(_))));
        let response = format!(
            r#"{{"content": [{{"type": "tool_use", "input": {}}}]}}"#,
            deep(100_000)
        );
        let read = ResponseBody::read(Endpoint::Messages, response.as_bytes());
        assert!(matches!(read, Err(ReadError::Invalid(_))));
    }

    #[test]
    fn every_cut_of_a_body_is_an_error_never_a_panic() {
        let request = json!({"model": "m", "system": [{"type": "text", "text": "s"}],
            "instructions": "i", "prompt": ["p", ["q"]], "suffix": "x", "input": [
                {"content": "c", "role": "user"},
                {"output": "o", "type": "function_call_output"}],
            "messages": [
                {"content": [{"text": "t", "type": "text"},
                    {"content": "r", "type": "tool_result"},
                    {"source": {"data": "d", "type": "text"}, "type": "document", "title": "n"},
                    {"content": [{"text": "u", "type": "text"}], "type": "search_result"}],
                 "role": "user"},
                {"role": "tool", "content": "xé\"y"}]});
        let response = json!({"choices": [{"message": {"content": "a", "refusal": "b",
            "tool_calls": [{"function": {"arguments": "{}"}}]}, "text": "t"}],
            "output": [{"arguments": "g", "content": [{"text": "h"}]}],
            "content": [{"text": "k"}], "usage": {"n": 1}});
        // `read` gives the number of texts read.
        let every_cut_fails = |body: &str, read: &dyn Fn(&[u8]) -> Result<usize, ReadError>| {
            assert!(read(body.as_bytes()).unwrap() > 0, "{body}");
            for cut in 0..body.len() {
                let cut = &body.as_bytes()[..cut];
                assert!(read(cut).is_err(), "{}", String::from_utf8_lossy(cut));
            }
        };
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Responses,
            Endpoint::Messages,
        ] {
            let read_request =
                |body: &[u8]| RequestBody::read(endpoint, body).map(|read| read.texts.len());
            every_cut_fails(&request.to_string(), &read_request);
            every_cut_fails(&kind_first(&request), &read_request);
            every_cut_fails(&response.to_string(), &|body: &[u8]| {
                ResponseBody::read(endpoint, body).map(|read| read.texts.len())
            });
        }
        let input = json!({"body": request, "custom_id": "a", "url": "/v1/chat/completions"});
        every_cut_fails(&input.to_string(), &|line: &[u8]| {
            read_batch_input(line).map(|read| read.params.texts.len())
        });
        let batch = json!({"requests": [{"custom_id": "a", "params": request}]});
        every_cut_fails(&batch.to_string(), &|body: &[u8]| {
            read_batch(body).map(|read| read[0].params.texts.len())
        });
        let mut body = response.clone();
        body["object"] = json!("chat.completion");
        for (dialect, line) in [
            (Dialect::Anthropic, json!({"result": {"message": response}})),
            (Dialect::OpenAi, json!({"response": {"body": body}})),
        ] {
            every_cut_fails(&line.to_string(), &|line: &[u8]| {
                let read = read_batch_line(dialect, line)?;
                Ok(read.answer.map_or(0, |answer| answer.texts.len()))
            });
        }
    }

    #[test]
    fn batch_requests_are_told_by_method_and_path() {
        use http::Method;
        let cases = [
            (Method::POST, "/v1/messages/batches", Some(Batch::Create)),
            (
                Method::POST,
                "/anthropic/v1/messages/batches/",
                Some(Batch::Create),
            ),
            (Method::GET, "/v1/messages/batches", Some(Batch::Objects)),
            (
                Method::GET,
                "/v1/messages/batches/msgbatch_1",
                Some(Batch::Objects),
            ),
            (
                Method::POST,
                "/v1/messages/batches/msgbatch_1/cancel",
                Some(Batch::Objects),
            ),
            (
                Method::GET,
                "/v1/messages/batches/msgbatch_1/results",
                Some(Batch::Results),
            ),
            (
                Method::GET,
                "/v1/files/file-1/content",
                Some(Batch::FileContent),
            ),
            (Method::DELETE, "/v1/messages/batches/msgbatch_1", None),
            (
                Method::POST,
                "/v1/messages/batches/msgbatch_1/results",
                None,
            ),
            (Method::GET, "/v1/files/file-1", None),
            (Method::POST, "/v1/files", Some(Batch::Upload)),
            (Method::GET, "/v1/files", None),
            (Method::GET, "/v1/messages", None),
            (
                Method::POST,
                "/v1/uploads",
                Some(Batch::Parts(PartsStep::Create)),
            ),
            (
                Method::POST,
                "/v1/uploads/upload_1/parts",
                Some(Batch::Parts(PartsStep::Part)),
            ),
            (
                Method::POST,
                "/v1/uploads/upload_1/complete",
                Some(Batch::Parts(PartsStep::Complete)),
            ),
            (
                Method::POST,
                "/v1/uploads/upload_1/cancel",
                Some(Batch::Parts(PartsStep::Cancel)),
            ),
            // Azure OpenAI's classic paths, and Gemini's, have no `v1`.
            (
                Method::GET,
                "/openai/files/file-1/content",
                Some(Batch::FileContent),
            ),
            (Method::POST, "/openai/files", Some(Batch::Upload)),
            (Method::POST, "/v1beta/openai/files", Some(Batch::Upload)),
            (Method::POST, "/v2/files", None),
        ];
        for (method, path, batch) in cases {
            assert_eq!(Batch::from_request(&method, path), batch, "{method} {path}");
        }
    }

    #[test]
    fn batch_lines_are_read_in_each_dialect() {
        let line = json!({"custom_id": "a", "result": {"type": "succeeded", "message": {
            "model": "claude-x", "usage": {"output_tokens": 9},
            "content": [{"type": "text", "text": "hi"}]}}})
        .to_string();
        let read = read_batch_line(Dialect::Anthropic, line.as_bytes()).unwrap();
        assert!(read.batch);
        assert_eq!(read.custom_id.as_deref(), Some("a"));
        let answer = read.answer.unwrap();
        assert_eq!(answer.endpoint, Endpoint::Messages);
        assert_eq!(answer.model.as_deref(), Some("claude-x"));
        assert_eq!(answer.usage, Some(r#"{"output_tokens":9}"#));
        assert_eq!(answer.texts[0].text, "hi");
        assert_eq!(&line[answer.texts[0].span.clone()], "\"hi\"");
        // OpenAI's by the answer's `object`; one it does not know, and a
        // failed request, have no answer.
        for (object, endpoint) in [
            ("response", Some(Endpoint::Responses)),
            ("text_completion", Some(Endpoint::Completions)),
            ("list", None),
        ] {
            let line =
                json!({"response": {"body": {"object": object, "output": []}}, "custom_id": "b"});
            let line = line.to_string();
            let read = read_batch_line(Dialect::OpenAi, line.as_bytes()).unwrap();
            assert!(read.batch);
            assert_eq!(read.answer.map(|a| a.endpoint), endpoint, "{object}");
        }
        let failed = r#"{"custom_id": "c", "response": null, "error": {"message": "x"}}"#;
        let read = read_batch_line(Dialect::OpenAi, failed.as_bytes()).unwrap();
        assert!(read.batch && read.answer.is_none());
        let other = read_batch_line(Dialect::OpenAi, br#"{"text": "x"}"#).unwrap();
        assert!(!other.batch);
        assert!(read_batch_line(Dialect::OpenAi, b"{\"custom_id\": ").is_err());
    }

    /// The texts of a Realtime client event, each with its scope, and its
    /// type and id; each span is the text's JSON string in the event.
    fn realtime_texts(event: &Value) -> (Option<String>, Option<String>, Vec<(Scope, String)>) {
        let body = event.to_string();
        let read = read_realtime_event(body.as_bytes()).unwrap();
        let texts = read
            .texts
            .iter()
            .map(|t| {
                if !t.definition {
                    let quoted: String = serde_json::from_str(&body[t.span.clone()]).unwrap();
                    assert_eq!(quoted, t.text);
                }
                (t.scope, t.text.to_string())
            })
            .collect();
        let owned = |text: Option<Cow<str>>| text.map(Cow::into_owned);
        (owned(read.kind), owned(read.event_id), texts)
    }

    #[test]
    fn compactions_are_found_by_path_and_read_as_responses_input() {
        for (path, compacts) in [
            ("/v1/responses/compact", true),
            ("/openai/v1/responses/compact/", true),
            ("/openai/responses/compact", true),
            ("/v1/responses/resp_1", false),
            ("/v1/responses", false),
            ("/v1/compact", false),
        ] {
            assert_eq!(compacts_conversation(path), compacts, "{path}");
        }
        let body = json!({"model": "gpt-5", "instructions": "Keep it short.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "asked"}]},
            {"type": "function_call_output", "call_id": "c", "output": "looked up"},
            {"type": "compaction", "encrypted_content": "gAAAA"}
        ], "previous_response_id": "resp_1"})
        .to_string();
        let (read, names) = read_compaction(body.as_bytes()).unwrap();
        assert_eq!(read.params.model.as_deref(), Some("gpt-5"));
        assert_eq!(names, ["input", "instructions"]);
        let texts: Vec<_> = (read.params.texts.iter())
            .map(|t| (t.scope, &*t.text))
            .collect();
        assert_eq!(
            texts,
            [
                (Scope::Prompt, "asked"),
                (Scope::Context, "looked up"),
                (Scope::Prompt, "Keep it short.")
            ]
        );
        // A key given twice: which one the API reads cannot be told.
        assert!(read_compaction(br#"{"input": "hi", "input": "again"}"#).is_err());
    }

    #[test]
    fn token_counts_are_found_by_path_and_read_as_their_endpoints_requests() {
        for (path, counts) in [
            ("/v1/messages/count_tokens", Some(Endpoint::Messages)),
            (
                "/anthropic/v1/messages/count_tokens/",
                Some(Endpoint::Messages),
            ),
            ("/v1/responses/input_tokens", Some(Endpoint::Responses)),
            (
                "/openai/v1/responses/input_tokens",
                Some(Endpoint::Responses),
            ),
            ("/v1/messages", None),
            ("/v1/responses/resp_1/input_items", None),
            ("/v1/count_tokens", None),
            ("/v1/messages/batches", None),
        ] {
            assert_eq!(counts_tokens(path), counts, "{path}");
        }
        let body = json!({"model": "claude-sonnet-4-5", "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "asked"},
                {"type": "tool_result", "tool_use_id": "t", "content": "looked up"}]}],
            "tools": [{"name": "quote", "description": "Gets a quote.",
                "input_schema": {"type": "object"}}]})
        .to_string();
        let read = read_token_count(Endpoint::Messages, body.as_bytes()).unwrap();
        assert_eq!(read.params.model.as_deref(), Some("claude-sonnet-4-5"));
        let texts: Vec<_> = (read.params.texts.iter())
            .filter(|t| !t.definition)
            .map(|t| (t.scope, &*t.text))
            .collect();
        assert_eq!(
            texts,
            [
                (Scope::Prompt, "Be brief."),
                (Scope::Prompt, "asked"),
                (Scope::Context, "looked up")
            ]
        );
        assert!(read.params.texts.iter().any(|t| t.definition));
        let body = json!({"model": "gpt-5", "instructions": "Be brief.", "input": "asked"});
        let body = body.to_string();
        let read = read_token_count(Endpoint::Responses, body.as_bytes()).unwrap();
        let texts: Vec<_> = (read.params.texts.iter())
            .map(|t| (t.scope, &*t.text))
            .collect();
        assert_eq!(
            texts,
            [(Scope::Prompt, "Be brief."), (Scope::Prompt, "asked")]
        );
        assert!(
            read_token_count(Endpoint::Messages, br#"{"system": "a", "system": "b"}"#).is_err()
        );
    }

    #[test]
    fn media_requests_are_found_by_path_and_their_texts_read_with_their_names() {
        for (path, media) in [
            ("/v1/images/generations", true),
            ("/v1/images/edits/", true),
            ("/openai/deployments/dalle3/images/generations", true),
            ("/v1beta/openai/images/generations", true),
            ("/v1/videos", true),
            ("/v1/videos/video_1/remix", true),
            ("/v1/videos/edits", true),
            ("/v1/audio/speech", true),
            ("/openai/v1/audio/transcriptions", true),
            ("/v1/images/variations", false),
            ("/v1/videos/characters", false),
            ("/v1/videos/video_1", false),
            ("/v1/audio/voices", false),
            ("/v1/chat/completions", false),
        ] {
            assert_eq!(makes_media(path), media, "{path}");
        }
        let body = json!({"model": "gpt-4o-mini-tts", "voice": "alloy", "input": "Hi \"you\".",
            "instructions": "Speak softly.", "prompt": ["not", "a string"]})
        .to_string();
        let (read, names) = read_media_request(body.as_bytes()).unwrap();
        assert_eq!(read.params.model.as_deref(), Some("gpt-4o-mini-tts"));
        assert_eq!(names, ["input", "instructions"]);
        let texts: Vec<_> = (read.params.texts.iter())
            .map(|t| (t.scope, t.text.to_string(), &body[t.span.clone()]))
            .collect();
        assert_eq!(
            texts,
            [
                (Scope::Prompt, "Hi \"you\".".into(), r#""Hi \"you\".""#),
                (Scope::Prompt, "Speak softly.".into(), r#""Speak softly.""#),
            ]
        );
        let twice = br#"{"prompt": "A cat.", "prompt": "A dog."}"#;
        assert!(matches!(
            read_media_request(twice),
            Err(ReadError::Ambiguous(_))
        ));
    }

    #[test]
    fn realtime_setups_are_found_by_path_and_read_at_either_level() {
        for (path, setup) in [
            ("/v1/realtime/client_secrets", true),
            ("/openai/v1/realtime/calls", true),
            ("/v1/realtime/calls/rtc_1/accept", true),
            ("/v1/realtime/sessions/", true),
            ("/v1/realtime/calls/rtc_1/hangup", false),
            ("/v1/realtime", false),
            ("/v1/client_secrets", false),
        ] {
            assert_eq!(sets_up_realtime(path), setup, "{path}");
        }
        let nested = json!({"session": {"instructions": "Be kind.", "tools": [], "prompt": {
            "id": "p", "variables": {"q": "Why?"}}}, "expires_after": {"seconds": 60}});
        let top = nested["session"].to_string();
        for body in [nested.to_string(), top] {
            let read = read_realtime_setup(body.as_bytes()).unwrap();
            let texts: Vec<_> = read
                .params
                .texts
                .iter()
                .map(|t| (t.scope, t.definition))
                .collect();
            assert_eq!(
                texts,
                [
                    (Scope::Prompt, false),
                    (Scope::Prompt, false),
                    (Scope::Context, true)
                ],
                "{body}"
            );
            assert_eq!(read.params.texts[0].text, "Be kind.");
            assert_eq!(read.params.texts[1].text, "Why?");
        }
        assert!(read_realtime_setup(b"v=0").is_err());
    }

    #[test]
    fn realtime_client_events_are_read_as_responses_input() {
        let item = json!({"type": "conversation.item.create", "event_id": "evt_1", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_audio", "audio": "AAAA"}]}});
        let (kind, id, texts) = realtime_texts(&item);
        assert_eq!(kind.as_deref(), Some("conversation.item.create"));
        assert_eq!(id.as_deref(), Some("evt_1"));
        assert_eq!(texts, [(Scope::Prompt, "Hello".to_owned())]);

        // A tool's output given back is context; the model's own turn is
        // not read.
        let output = json!({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "c1", "output": "{\"balance\": 12}"}});
        assert_eq!(
            realtime_texts(&output).2,
            [(Scope::Context, "{\"balance\": 12}".to_owned())]
        );
        let assistant = json!({"type": "conversation.item.create", "item": {
            "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Earlier answer"}]}});
        assert!(realtime_texts(&assistant).2.is_empty());

        // Instructions and input of a response, instructions and tools of a
        // session (the tools as one definition).
        let response = json!({"type": "response.create", "response": {
            "instructions": "Be brief.",
            "input": [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Out of band"}]}]}});
        assert_eq!(
            realtime_texts(&response).2,
            [
                (Scope::Prompt, "Be brief.".to_owned()),
                (Scope::Prompt, "Out of band".to_owned())
            ]
        );
        // A stored prompt's variables, in a session or a response, are
        // the user's words as in the Responses API.
        for key in ["session", "response"] {
            let event = json!({"type": "x", key: {"prompt": {"id": "pmpt_1", "variables": {
                "question": "Which fund?", "doc": {"type": "input_text", "text": "Rates"}}}}});
            assert_eq!(
                realtime_texts(&event).2,
                [
                    (Scope::Prompt, "Rates".to_owned()),
                    (Scope::Prompt, "Which fund?".to_owned())
                ]
            );
        }
        let session = json!({"type": "session.update", "session": {
            "instructions": "You are a coach.",
            "tools": [{"type": "function", "name": "f", "description": "Looks up rates."}]}});
        let texts = realtime_texts(&session).2;
        assert_eq!(texts[0], (Scope::Prompt, "You are a coach.".to_owned()));
        assert_eq!(texts[1].0, Scope::Context);
        assert!(texts[1].1.contains("Looks up rates."));

        // Audio and other events carry nothing to read.
        let append = json!({"type": "input_audio_buffer.append", "audio": "AAAA"});
        assert!(realtime_texts(&append).2.is_empty());
        // A key read twice is ambiguous; what is not JSON is not read.
        let twice =
            br#"{"type":"session.update","session":{"instructions":"a","instructions":"b"}}"#;
        assert!(matches!(
            read_realtime_event(twice),
            Err(ReadError::Ambiguous(_))
        ));
        assert!(matches!(
            read_realtime_event(b"hello"),
            Err(ReadError::Invalid(_))
        ));
    }

    #[test]
    fn endpoints_are_found_after_any_prefix() {
        for (path, endpoint) in [
            ("/v1/chat/completions", Some(Endpoint::ChatCompletions)),
            ("/v1/chat/completions/", Some(Endpoint::ChatCompletions)),
            ("/v1/completions", Some(Endpoint::Completions)),
            ("/v1/responses", Some(Endpoint::Responses)),
            ("/v1/messages", Some(Endpoint::Messages)),
            (
                "/openai/v1/chat/completions",
                Some(Endpoint::ChatCompletions),
            ),
            ("/api/v1/messages", Some(Endpoint::Messages)),
            (
                "/openai/deployments/gpt-4o/chat/completions",
                Some(Endpoint::ChatCompletions),
            ),
            (
                "/openai/deployments/davinci/completions",
                Some(Endpoint::Completions),
            ),
            // The base URLs providers give.
            ("/chat/completions", Some(Endpoint::ChatCompletions)),
            (
                "/v1beta/openai/chat/completions",
                Some(Endpoint::ChatCompletions),
            ),
            ("/openai/responses", Some(Endpoint::Responses)),
            (
                "/inference/chat/completions/",
                Some(Endpoint::ChatCompletions),
            ),
            (
                "/v1/projects/p/locations/us-central1/endpoints/openapi/chat/completions",
                Some(Endpoint::ChatCompletions),
            ),
            ("/anthropic/v1/messages", Some(Endpoint::Messages)),
            ("/openai/deployments/gpt-4o/embeddings", None),
            ("/v1/threads/thread_1/messages", None),
            ("/openai/threads/thread_1/messages", None),
            ("/v1/chat/completions/chatcmpl-1/messages", None),
            ("/v1/responses/resp_1", None),
            ("/v1/responses/resp_1/input_items", None),
            ("/v1/messages/batches", None),
            ("/v1/messages/count_tokens", None),
            ("/v1/embeddings", None),
        ] {
            assert_eq!(Endpoint::from_path(path), endpoint, "{path}");
        }
    }

    #[test]
    fn stored_answers_are_read_as_responses() {
        use http::Method;
        for (path, stored) in [
            ("/v1/responses/resp_1", Some(Stored::Response)),
            ("/v1/responses/resp_1/", Some(Stored::Response)),
            ("/v1/responses/resp_1/input_items", None),
            ("/v1/responses", None),
            ("/v1/chat/completions", Some(Stored::ChatCompletions)),
            (
                "/v1/chat/completions/chatcmpl-1",
                Some(Stored::ChatCompletion),
            ),
            ("/v1/chat/completions/chatcmpl-1/messages", None),
            ("/v1/conversations/conv_1/items", Some(Stored::Items)),
            ("/v1/conversations/conv_1/items/msg_1", Some(Stored::Item)),
            ("/v1/conversations/conv_1", None),
            ("/openai/v1/responses/resp_1", Some(Stored::Response)),
            // Azure OpenAI's classic paths, and Gemini's, have no `v1`.
            ("/openai/responses/resp_1", Some(Stored::Response)),
            (
                "/openai/chat/completions/chatcmpl-1",
                Some(Stored::ChatCompletion),
            ),
            (
                "/v1beta/openai/chat/completions",
                Some(Stored::ChatCompletions),
            ),
            ("/api/gw/eu/v1/responses/resp_1", Some(Stored::Response)),
            ("/v1/conversations/conv_1/items/msg_1/x", None),
            ("/v1/a/b/c/v1/responses/resp_1", Some(Stored::Response)),
            ("/v2/responses/resp_1", None),
            ("/v1/models", None),
        ] {
            assert_eq!(Stored::from_request(&Method::GET, path), stored, "{path}");
        }
        // A cancel answers with the response, a metadata update with the
        // completion; the other methods' answers hold no output.
        for (method, path, stored) in [
            (
                Method::POST,
                "/v1/responses/resp_1/cancel",
                Some(Stored::Response),
            ),
            (Method::GET, "/v1/responses/resp_1/cancel", None),
            (Method::POST, "/v1/responses/resp_1", None),
            (
                Method::POST,
                "/v1/chat/completions/chatcmpl-1",
                Some(Stored::ChatCompletion),
            ),
            (Method::DELETE, "/v1/chat/completions/chatcmpl-1", None),
            (Method::POST, "/v1/conversations/conv_1/items", None),
        ] {
            assert_eq!(
                Stored::from_request(&method, path),
                stored,
                "{method} {path}"
            );
        }
        let message = |role: &str, text: &str| json!({"type": "message", "role": role, "content": [{"type": "output_text", "text": text}]});
        let completion = |text: &str| json!({"choices": [{"message": {"content": text}}]});
        for (stored, body, expected) in [
            (
                Stored::Response,
                json!({"output": [message("assistant", "said"), {"type": "reasoning", "summary": [{"text": "thought"}]}]}),
                vec!["said", "thought"],
            ),
            (Stored::ChatCompletion, completion("one"), vec!["one"]),
            (
                Stored::ChatCompletions,
                json!({"object": "list", "data": [completion("one"), completion("two")]}),
                vec!["one", "two"],
            ),
            (
                Stored::Items,
                json!({"data": [message("user", "asked"), message("assistant", "answered"), {"type": "function_call", "arguments": "{}"}]}),
                vec!["answered", "{}"],
            ),
            (
                Stored::Item,
                message("assistant", "answered"),
                vec!["answered"],
            ),
            (Stored::Item, message("user", "asked"), vec![]),
        ] {
            let body = body.to_string();
            let read = ResponseBody::read_stored(stored, body.as_bytes()).unwrap();
            let texts: Vec<String> = read
                .texts
                .into_iter()
                .map(|t| t.text.into_owned())
                .collect();
            assert_eq!(texts, expected, "{body}");
        }
        let cut = r#"{"data": [{"role": "assistant", "content": [{"text": "a"#;
        assert!(ResponseBody::read_stored(Stored::Items, cut.as_bytes()).is_err());
    }

    #[test]
    fn response_texts_of_each_endpoint() {
        let mut seen = Vec::new();
        for (endpoint, body) in [
            (
                Endpoint::ChatCompletions,
                json!({"choices": [{"message": {"reasoning_content": "mulls", "content": "hello", "refusal": null, "tool_calls": [{"function": {"arguments": "{\"a\":1}"}}, {"type": "custom", "custom": {"name": "patch", "input": "custom in"}}], "reasoning": "ponders", "function_call": {"name": "f", "arguments": "legacy"}}}], "usage": {"total_tokens": 3}}),
            ),
            (
                Endpoint::Messages,
                json!({"content": [{"type": "thinking", "thinking": "claude thinks", "signature": "sig"}, {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "claude says"}, {"type": "tool_use", "input": {"note": "in", "n": 2, "to": ["a", {"b": "deep"}]}}]}),
            ),
            (
                Endpoint::Responses,
                json!({"output": [
                    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "summed up"}], "content": [{"type": "reasoning_text", "text": "reasoned"}]},
                    {"type": "message", "content": [{"type": "output_text", "text": "resp"}]},
                    {"type": "custom_tool_call", "call_id": "c", "name": "patch", "input": "custom input"},
                    {"type": "code_interpreter_call", "container_id": "k", "code": "print(1)", "outputs": null},
                    {"type": "mcp_call", "name": "tip", "arguments": "{\"q\":1}", "output": "the server's"}]}),
            ),
            (
                Endpoint::Completions,
                json!({"choices": [{"text": "completed"}]}),
            ),
        ] {
            let body = body.to_string();
            let read = ResponseBody::read(endpoint, body.as_bytes()).unwrap();
            if endpoint == Endpoint::ChatCompletions {
                assert_eq!(read.usage, Some(r#"{"total_tokens":3}"#));
            }
            seen.extend(read.texts.into_iter().map(|t| t.text.into_owned()));
        }
        assert_eq!(
            seen,
            [
                "hello",
                "legacy",
                "ponders",
                "mulls",
                "{\"a\":1}",
                "custom in",
                "claude thinks",
                "claude says",
                "in",
                "a",
                "deep",
                "reasoned",
                "summed up",
                "resp",
                "custom input",
                "print(1)",
                "{\"q\":1}",
                // What the MCP server gave the model: context.
                "the server's",
                "completed"
            ]
        );
    }
}
