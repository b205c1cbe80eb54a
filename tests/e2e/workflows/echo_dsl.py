"""e2e-dsl: imported into the studio as Python DSL source by the browser test."""

from engine.flow.dsl import Workflow

wf = Workflow('e2e-dsl', description='a DSL source import')
wf.role('py', kind='python')
wf.node('message', 'input', params={'default': 'hello'}, outputs={'value': 'text'})
wf.node('shout', 'python', role='py', op='router.echo', inputs={'text': 'text'}, outputs={'out': 'text'})
wf.node('reply', 'output', inputs={'value': 'text'})
wf.edge('message.value', 'shout.text')
wf.edge('shout.out', 'reply.value')

workflow = wf
