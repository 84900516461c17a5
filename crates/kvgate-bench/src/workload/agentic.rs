//! `agentic`: agents that share a long `tools` array and a system prompt, each running
//! repeated tool-call rounds.
//!
//! Round 1 sends `[system, user task]` with the tools. After each round but the last, the
//! history gains the assistant's tool call (scripted: an engine under test rarely emits
//! real tool calls, so the call is fixed whatever the server answered) and the tool's
//! result, and the next round is sent. Every round's messages extend the previous round's;
//! the tools and system prompt are the same for every agent, so all requests share a long
//! prefix and each agent's requests share an even longer one.

use serde_json::{Value, json};

use super::{
    BodyOptions, ChatBuilder, ChatHead, Conversation, Reply, Workload, message,
    shared_prefix::stream,
};
use crate::text::Rng;

/// Parameters of the `agentic` workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agentic {
    /// Number of agents (concurrent conversations).
    pub agents: u32,
    /// Tool-call rounds (requests) per agent.
    pub rounds: u32,
    /// Number of tools in the `tools` array.
    pub tools: u32,
    /// Words in each tool's description (the schemas' bulk).
    pub tool_description_tokens: u32,
    /// Words in each agent's task.
    pub task_tokens: u32,
    /// Words in each tool result.
    pub result_tokens: u32,
}

impl Default for Agentic {
    fn default() -> Self {
        Self {
            agents: 8,
            rounds: 4,
            tools: 12,
            tool_description_tokens: 120,
            task_tokens: 48,
            result_tokens: 160,
        }
    }
}

impl Agentic {
    /// Generates the workload for `seed`.
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Workload {
        let tools = self.tools_array(seed);
        let system = format!(
            "You are an autonomous agent. Use the tools to finish the task. {}",
            Rng::new(seed, stream(4, 0, 0)).words(64)
        );
        let conversations = (0..self.agents)
            .map(|agent| self.agent(body, seed, agent, &tools, &system))
            .collect();
        Workload {
            name: format!(
                "agentic(agents={}, rounds={}, tools={})",
                self.agents, self.rounds, self.tools
            ),
            conversations,
        }
    }

    fn tools_array(&self, seed: u64) -> Value {
        let mut rng = Rng::new(seed, stream(5, 0, 0));
        let tools: Vec<Value> = (0..self.tools)
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": format!("tool_{t}"),
                        "description": rng.words(self.tool_description_tokens as usize),
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "query": {"type": "string", "description": rng.words(12)},
                                "limit": {"type": "integer", "description": rng.words(8)},
                                "mode": {"type": "string", "enum": ["fast", "exact", "deep"]},
                            },
                            "required": ["query"],
                        },
                    },
                })
            })
            .collect();
        Value::Array(tools)
    }

    fn agent(
        &self,
        body: &BodyOptions,
        seed: u64,
        agent: u32,
        tools: &Value,
        system: &str,
    ) -> Conversation {
        let head = ChatHead::new(body, vec![("tools", tools.clone())]);
        let mut builder = ChatBuilder::new(head);
        let mut rng = Rng::new(seed, stream(6, agent, 0));
        let mut append = vec![
            message("system", system.to_owned()),
            message(
                "user",
                format!("Task {agent}: {}", rng.words(self.task_tokens as usize)),
            ),
        ];
        for round in 0..self.rounds {
            let call_id = format!("call_{agent}_{round}");
            let reply = if round + 1 < self.rounds {
                let tool = rng.below(self.tools.max(1) as usize);
                let arguments = json!({"query": rng.words(6), "limit": 10}).to_string();
                Reply::Scripted(json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "id": call_id,
                        "type": "function",
                        "function": {"name": format!("tool_{tool}"), "arguments": arguments},
                    }],
                }))
            } else {
                Reply::Text(rng.words(32))
            };
            builder.turn(std::mem::take(&mut append), reply);
            append.push(json!({
                "role": "tool",
                "tool_call_id": call_id,
                "content": rng.words(self.result_tokens as usize),
            }));
        }
        builder.finish(agent, agent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_support::{
        assert_deterministic, assert_histories_grow, messages, parsed,
    };

    fn spec() -> Agentic {
        Agentic {
            agents: 3,
            rounds: 4,
            tools: 5,
            tool_description_tokens: 50,
            task_tokens: 10,
            result_tokens: 20,
        }
    }

    #[test]
    fn deterministic_per_seed() {
        assert_deterministic(|seed| spec().generate(&BodyOptions::default(), seed));
    }

    #[test]
    fn rounds_append_tool_call_and_result_and_share_the_tools() {
        let w = spec().generate(&BodyOptions::default(), 3);
        assert_eq!(w.request_count(), 12);
        assert_histories_grow(&w);
        let bodies = parsed(&w);
        let tools = &bodies[0][0]["tools"];
        assert_eq!(tools.as_array().unwrap().len(), 5);
        for turns in &bodies {
            for (k, turn) in turns.iter().enumerate() {
                assert_eq!(&turn["tools"], tools, "same tools everywhere");
                if k > 0 {
                    let m = messages(turn);
                    let n = m.len();
                    assert_eq!(m[n - 2]["role"], "assistant");
                    assert!(m[n - 2]["tool_calls"].is_array());
                    assert_eq!(m[n - 1]["role"], "tool");
                    assert_eq!(m[n - 1]["tool_call_id"], m[n - 2]["tool_calls"][0]["id"]);
                }
            }
        }
    }
}
